"""What a remote tensor's `untyped_storage()` and `data_ptr()` say: one storage per server storage,
shared by the tensor's views and detached aliases, at an address of its own.

A wrapper subclass's own storage holds no memory, refuses `data_ptr()`, and is one per view; code
that tells storages apart by address (safetensors' `save_file`, transformers' `save_pretrained` and
its tied weights) needs what CUDA gives. So the storage a remote tensor names is a `SharedStorage`'s,
made on first use: tagged with the device, at an address no process memory has (nothing reads
through it), as big as the tensor the views came from, and the same object for every view,
`detach()`, `set_` and `.data =` of it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .output_specs import Layout

_BASE = 1 << 62  # addresses from here: past any process's memory, and past CPU addresses torch.load tags
_END = (1 << 63) - 1  # (a storage's address is a signed 64-bit pointer)
_PAGE = 4096
_cursor = _BASE
_cursor_lock = threading.Lock()
_COMPOSITE = "CompositeImplicitAutograd"
# a storage object (by its address in this process) -> the SharedStorage it names: `set_(storage)`
_by_storage: weakref.WeakValueDictionary[int, SharedStorage] = weakref.WeakValueDictionary()


def _address(nbytes: int) -> int:
    """A range of addresses of its own, a page apart from the last one's."""
    global _cursor
    with _cursor_lock:
        start = _cursor
        _cursor += -(-max(nbytes, 1) // _PAGE) * _PAGE + _PAGE
        if _cursor > _END:
            raise RuntimeError("remote_accelerator: out of storage addresses in this process")
    return start


class SharedStorage:
    """The server storage a remote tensor and its views share; its storage object made on first ask,
    and the handles of the tensors that asked for it (any one still alive names the server's)."""

    __slots__ = ("__weakref__", "layout", "owners", "storage")

    def __init__(self, layout: Layout) -> None:
        self.layout = layout  # of the tensor the views came from: its extent is the storage's size
        self.storage: Any = None
        self.owners: weakref.WeakSet[Any] = weakref.WeakSet()

    def storage_on(self, device: torch.device, owner: Any) -> Any:
        """The storage object, `owner` (a tensor's handle) remembered as one that names it."""
        if self.storage is None:
            nbytes = _nbytes(self.layout)
            self.storage = torch._C._construct_storage_from_data_pointer(_address(nbytes), device, nbytes)
            _by_storage[self.storage._cdata] = self
        if owner is not None:
            self.owners.add(owner)
        return self.storage

    def owner(self) -> Any:
        """A handle of a live tensor that names this storage, or None."""
        return next(iter(self.owners), None)


def named_by(storage: Any) -> SharedStorage | None:
    """The shared storage a storage object is (from a remote tensor's `untyped_storage()`), or None."""
    return _by_storage.get(storage._cdata)


def of(tensor: Any) -> SharedStorage:
    """`tensor`'s shared storage, made for it if it has none yet."""
    shared = tensor.__dict__.get("_shared")
    if shared is None:
        shared = tensor._shared = SharedStorage(tensor._layout)
        handle = tensor.__dict__.get("_handle")
        if handle is not None:  # (the tensor the views come from names it while it lives)
            shared.owners.add(handle)
    return shared


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
    """`view` (a remote tensor an op just made, or one `set_` or `.data =` pointed elsewhere) names
    `base`'s storage."""
    view._shared = of(base)
