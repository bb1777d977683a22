"""`torch.accelerator` on `remote_accelerator`: the calls it makes into C++ answered by the device module.

PyTorch's device-generic API (`torch.accelerator.synchronize`, `memory_allocated`, `memory_stats`,
`empty_cache`, ...) asks the current accelerator's C++ device guard and allocators, which a device
defined in Python (torch.utils.backend_registration) lacks: PyTorch's own calls raise, fail an
internal assert or (`empty_host_cache`) crash the process, and every utility built on them with
them (`torch.utils.benchmark.Timer`, even timing CPU code), on a client with no GPU of its own,
where `remote_accelerator` is the current accelerator.

So the few `torch._C._accelerator_*` functions these reach are wrapped, once, when the device is
registered: while the current accelerator is `remote_accelerator` they ask `torch.remote_accelerator`
(one round trip each, as its own functions do); for any other accelerator (a client's own GPU) they
call PyTorch's, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .connection import DEVICE_TYPE, _connected, current_index


def _at(index: int) -> int:
    return index if index >= 0 else current_index()  # (-1: the current device, as PyTorch's C++ reads it)


# torch._C's function -> its answer on remote_accelerator, from the device module and the same arguments
_ANSWERS: dict[str, Callable[..., Any]] = {
    "_accelerator_synchronizeDevice": lambda module, index: module.synchronize(_at(index)),
    # (flat names, as torch.cuda's: torch.accelerator.memory_stats flattens nested ones, keeps flat ones;
    # a CPU server keeps no peak, and torch.accelerator reads a stat not kept as 0, as for any backend)
    "_accelerator_getDeviceStats": lambda module, index: module.memory_stats(_at(index)),
    "_accelerator_isAllocatorInitialized": lambda module: _connected() is not None,
    "_accelerator_emptyCache": lambda module: module.empty_cache(),
    "_accelerator_resetPeakStats": lambda module, index: module.reset_peak_memory_stats(_at(index)),
    "_accelerator_resetAccumulatedStats": lambda module, index: module.reset_accumulated_memory_stats(_at(index)),
    "_accelerator_getMemoryInfo": lambda module, index: module.mem_get_info(_at(index)),
    # pinned memory here is page-locked per tensor and freed with it (pinned.py): no cache to empty
    # (PyTorch's own call crashes the process: a Python backend has no host allocator)
    "_accelerator_emptyHostCache": lambda module: None,
}


def _routed(name: str, pytorchs: Callable[..., Any], answer: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def call(*args: Any) -> Any:
        current = torch._C._accelerator_getAccelerator()
        if current is None or current.type != DEVICE_TYPE:
            return pytorchs(*args)
        return answer(torch.get_device_module(DEVICE_TYPE), *args)

    call.__name__ = call.__qualname__ = name
    call.__wrapped__ = pytorchs  # type: ignore[attr-defined]
    return call


def register() -> None:
    """Wrap the functions this torch has (2.11 has no host cache, for one); idempotent."""
    import torch

    for name, answer in _ANSWERS.items():
        pytorchs = getattr(torch._C, name, None)
        if pytorchs is not None and not hasattr(pytorchs, "__wrapped__"):
            setattr(torch._C, name, _routed(name, pytorchs, answer))
