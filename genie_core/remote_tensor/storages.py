"""What a remote tensor's `untyped_storage()` and `data_ptr()` say: one storage per server storage,
shared by the tensor's views and detached aliases, at an address of its own.

A wrapper subclass's own storage holds no memory and refuses `data_ptr()`, and each view gets one
of its own. Code that tells storages apart by address, as safetensors' `save_file` and
transformers' `save_pretrained` (tied weights) do, then failed on remote tensors, or would have
taken views for separate tensors. So the storage a remote tensor names is a `SharedStorage`, made
on first use: a storage tagged with the device at an address no process memory has (nothing reads
through it), as big as the tensor the views came from, and the same object for every view and
`detach()` of it, as on CUDA.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .output_specs import Layout

_BASE = 1 << 62  # addresses from here: past any process's memory, and past CPU addresses torch.load tags
_SPAN = 1 << 40  # bytes of address per storage
_LAST = ((1 << 63) - _BASE) // _SPAN - 1  # (a storage's address is a signed 64-bit pointer)
_next = itertools.count(1)
_COMPOSITE = "CompositeImplicitAutograd"


class SharedStorage:
    """The server storage a remote tensor and its views share; its storage object made on first ask."""

    __slots__ = ("layout", "storage")

    def __init__(self, layout: Layout) -> None:
        self.layout = layout  # of the tensor the views came from: its extent is the storage's size
        self.storage: Any = None

    def named(self, device: torch.device) -> Any:
        if self.storage is None:
            n = next(_next)
            if n > _LAST:
                raise RuntimeError("remote_accelerator: out of storage addresses in this process")
            self.storage = torch._C._construct_storage_from_data_pointer(
                _BASE + n * _SPAN, device, _nbytes(self.layout)
            )
        return self.storage


def _nbytes(layout: Layout) -> int:
    """Bytes from the storage's start to the end of the layout's last element (as PyTorch sizes a
    wrapper's storage)."""
    if any(n == 0 for n in layout.shape):
        return 0
    last = layout.offset + sum((n - 1) * s for n, s in zip(layout.shape, layout.stride, strict=True))
    return (last + 1) * layout.dtype.itemsize


def view_of(func: Any) -> int | None:
    """The position of the argument an op's outputs are views of, from its schema (not written:
    in-place and out= outputs are the argument itself); None when it makes tensors of its own. Not
    for ops that may copy instead (`reshape`, `contiguous`, `to`: composite, decomposed before they
    reach a device's kernels, as they reach remote tensors)."""
    returns = func._schema.returns
    info = returns[0].alias_info if len(returns) == 1 and getattr(func, "is_view", False) else None
    if info is None or info.is_write or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE):
        return None
    for position, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is None or alias.is_write or argument.kwarg_only:
            continue
        # `Tensor(a)`, or a list of views (`split(Tensor(a -> *) self) -> Tensor(a)[]`, whose return's
        # set PyTorch's binding leaves empty)
        if alias.before_set == info.before_set or (not info.before_set and "*" in alias.after_set):
            return position
    return None


def share(view: Any, base: Any) -> None:
    """`view` (a remote tensor an op just made) names `base`'s storage."""
    shared = base.__dict__.get("_shared")
    if shared is None:
        shared = base._shared = SharedStorage(base._layout)
    view._shared = shared
