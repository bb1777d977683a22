"""Which GPUs this machine has, through NVML. No NVIDIA driver means zero GPUs, not an error."""

from __future__ import annotations

from .nodes import GPUInfo


def list_gpus() -> tuple[list[GPUInfo], str]:
    """(each GPU's index, name, uuid and total memory, reason when there are none)."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], f"NVML unavailable ({exc})"
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus.append(
                GPUInfo(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else name,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                )
            )
        return gpus, "" if gpus else "NVML reports no GPUs"
    finally:
        pynvml.nvmlShutdown()
