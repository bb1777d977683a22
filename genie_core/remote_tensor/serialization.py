"""`torch.load(..., map_location="remote_accelerator:N")` for checkpoints saved from the CPU or CUDA.

PyTorch rebuilds such a tensor as `torch.empty(0, device=storage.device).set_(storage, ...)`. The
deserializer hands it a storage tagged with the remote device that points at the loaded bytes;
the remote tensor's `set_` then uploads those bytes once per storage, so views that shared a
storage in the file share it on the server too. Remote tensors are saved by torch.save as CUDA
tensors are, by their storage (fetched once, however many views name it: the storage's `cpu()`,
storages.py), and pickled elsewhere as their CPU values plus their device
(`RemoteTensor.__reduce_ex__`).
"""

from __future__ import annotations

import re
import sys
import weakref
from typing import Any

import torch

DEVICE_TYPE = "remote_accelerator"
_LOCATION = re.compile(rf"{DEVICE_TYPE}(:\d+)?$")


class LoadedBytes:
    """The CPU bytes behind one device-tagged storage, and their id on the server once uploaded."""

    __slots__ = ("__weakref__", "cpu", "rid", "stream")

    def __init__(self, cpu: Any) -> None:
        self.cpu = cpu
        self.rid: int | None = None
        self.stream: Any = None


# data_ptr of a device-tagged storage -> its bytes
loaded: dict[int, LoadedBytes] = {}


def _forget(ptr: int, entry: LoadedBytes) -> None:
    if loaded.get(ptr) is entry:
        del loaded[ptr]
    if entry.rid is not None and entry.stream is not None:
        entry.stream.free(entry.rid)


def _tag(storage: Any) -> None:
    return None  # a remote storage is tagged by PyTorch's own tagger ("remote_accelerator:N")


def _restore(storage: Any, location: str) -> Any:
    if not isinstance(location, str) or not _LOCATION.match(location) or storage.device.type != "cpu":
        return None
    from .connection import device_count

    device = torch.device(location)
    index = device.index or 0
    if index >= device_count():
        raise RuntimeError(
            f"Attempting to deserialize object on {location} but the connected server has {device_count()} "
            f"{DEVICE_TYPE} device(s); run %genie_init first, or pass map_location to torch.load"
        )
    tagged = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), torch.device(DEVICE_TYPE, index), storage.nbytes()
    )
    entry = LoadedBytes(storage)
    loaded[storage.data_ptr()] = entry
    weakref.finalize(tagged, _forget, storage.data_ptr(), entry)
    return tagged


def saved_by_torch_save() -> bool:
    """Whether torch.save's zip format is pickling the calling tensor: its storage is then saved
    once, as a CUDA tensor's is (views saved together share it again when loaded). Its legacy
    format is refused in words: it writes a storage's bytes from this process's memory (PyTorch's
    C++ would read the storage's address here), and loads a tensor saved as its values with wrong
    values, silently. (Called by a remote tensor's `__reduce_ex__`: the whole stack is looked at,
    whatever pickler, C or Python, runs between.)"""
    zipped = getattr(getattr(torch.serialization, "_save", None), "__code__", None)
    legacy = getattr(getattr(torch.serialization, "_legacy_save", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is legacy:
            raise RuntimeError(
                "torch.save(..., _use_new_zipfile_serialization=False) cannot hold remote_accelerator tensors "
                "(that format would load them with wrong values); use torch.save's default format, or save t.cpu()"
            )
        if frame.f_code is zipped:  # (but where it would copy storages through pinned memory, which a
            # device defined in Python cannot give: then by values)
            return not _pinned_copies()
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _pinned_copies() -> bool:
    """torch.save's `use_pinned_memory_for_d2h` setting (torch.utils.serialization.config)."""
    config = getattr(getattr(torch.utils, "serialization", None), "config", None)
    return bool(getattr(getattr(config, "save", None), "use_pinned_memory_for_d2h", False))


def register(lazy_bits: Any) -> None:
    """Before PyTorch's own privateuse1 deserializer (priority 23), which would try `storage.to(device)`;
    and a tensor's conjugate and negative bits, as torch.load sets them, made on the server too
    (`lazy_bits`: tensor.py's)."""
    # 22.5: between two of PyTorch's priorities (a tie would compare the functions); typed as int
    torch.serialization.register_package(22.5, _tag, _restore)  # type: ignore[arg-type]
    plain = torch._utils.set_tensor_metadata
    if getattr(plain, "_genie", False):
        return

    def set_tensor_metadata(tensor: Any, metadata: dict[str, Any]) -> None:
        if tensor.device.type == DEVICE_TYPE and type(tensor) is not torch.Tensor:
            lazy_bits(tensor, metadata)
        else:
            plain(tensor, metadata)

    set_tensor_metadata._genie = True  # type: ignore[attr-defined]
    torch._utils.set_tensor_metadata = set_tensor_metadata
