"""Pinned (page-locked) host memory once `remote_accelerator` is the accelerator.

With the device registered, PyTorch asks it for pinned memory (`Tensor.pin_memory()`,
`DataLoader(pin_memory=True)`), through a C++ hooks interface that a Python backend cannot fill
(so `torch.empty(..., pin_memory=True)`, which asks the hooks directly, stays refused). So the
two ops that pinning comes down to, `_pin_memory` and `is_pinned`, get CPU kernels here:
- beside a local CUDA GPU, pinning means what it always meant: CUDA's pinned memory;
- otherwise the memory is this module's: page-aligned and locked with mlock(2), so it is never
  paged out, as pinned memory is; a lock the OS refuses (RLIMIT_MEMLOCK, `ulimit -l`) is an error
  that says so, never memory silently left pageable.
Any other device named explicitly keeps PyTorch's own kernels.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref
from typing import Any

import torch

from .connection import DEVICE_TYPE

_DEFAULT = torch._C.DispatchKey.CompositeExplicitAutograd
_locked: dict[int, int] = {}  # address -> bytes, of the memory this module pinned and still alive
_libc: Any = None
_lib: Any = None


def _mlock(address: int, size: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mlock.argtypes = _libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) != 0:
        err = ctypes.get_errno()
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"
        except (ImportError, ValueError):
            limit = "unknown"
        raise RuntimeError(
            f"cannot pin {size / 2**20:.1f} MiB of host memory: {os.strerror(err)} (the memory lock limit, "
            f"`ulimit -l`, is {limit}; raise it, or leave pin_memory off)"
        )


def _unlocked(address: int) -> None:
    _locked.pop(address, None)  # munmap, when the mapping goes, unlocks it


def _locked_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in page-locked memory of this module's, laid out as `t` is."""
    storage = t.untyped_storage()
    size = max(storage.nbytes(), 1)
    mapping = mmap.mmap(-1, size)
    view = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(view)
    del view  # (an export would keep the mapping from closing)
    _mlock(address, size)
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=storage.nbytes()) if storage.nbytes() else None
    _locked[address] = size
    weakref.finalize(mapping, _unlocked, address)
    if flat is None:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    out = torch.empty(0, dtype=t.dtype).set_(flat.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    out.untyped_storage().copy_(storage)
    return out


def _for_this_device(device: Any) -> bool:
    return device is None or torch.device(device).type == DEVICE_TYPE


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    if not _for_this_device(device):
        return torch.ops.aten._pin_memory.default._op_dk(_DEFAULT, self, device)
    if torch.cuda.is_available():
        return torch.ops.aten._pin_memory.default._op_dk(_DEFAULT, self, torch.device("cuda"))
    return _locked_copy(self)


def _is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    if not _for_this_device(device):
        return bool(torch.ops.aten.is_pinned.default._op_dk(_DEFAULT, self, device))
    if self.untyped_storage().data_ptr() in _locked:
        return True
    if torch.cuda.is_available():
        return bool(torch.ops.aten.is_pinned.default._op_dk(_DEFAULT, self, torch.device("cuda")))
    return False


def register() -> None:
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("_pin_memory", _pin_memory, "CPU")
    _lib.impl("is_pinned", _is_pinned, "CPU")
