"""What a remote tensor's `untyped_storage()` and `data_ptr()` say: one storage per server storage,
shared by the tensor's views and detached aliases, at an address of its own.

A wrapper subclass's own storage holds no memory, refuses `data_ptr()`, and is one per view; code
that tells storages apart by address (safetensors' `save_file`, transformers' `save_pretrained` and
its tied weights) needs what CUDA gives. So the storage a remote tensor names is a `SharedStorage`'s,
made on first use: tagged with the device, at an address no process memory has (nothing reads
through it), as big as the tensor the views came from, and the same object for every view,
`detach()`, `set_` and `.data =` of it. Its methods that would touch memory at that address
(`byteswap`, `new`, `resize_`) and PyTorch's constructor of a storage on the device (`register`)
are done on the device, or refused in words: PyTorch's would crash the process; a tensor PyTorch's
C++ makes over it is the remote tensor it stands for (`as_remote`).
"""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from typing import Any

import torch

from .connection import DEVICE_TYPE
from .output_specs import Layout, layout_of

_BASE = 1 << 62  # addresses from here: past any process's memory, and past CPU addresses torch.load tags
_END = (1 << 63) - 1  # (a storage's address is a signed 64-bit pointer)
_PAGE = 4096
_cursor = _BASE
_cursor_lock = threading.Lock()
_COMPOSITE = "CompositeImplicitAutograd"
# an address handed out -> the shared storage there (addresses are never handed out twice)
_by_address: weakref.WeakValueDictionary[int, SharedStorage] = weakref.WeakValueDictionary()


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
    """The server storage a remote tensor and its views share: its address, given on first ask, and
    the handles of the tensors that asked for its storage object (any one still alive names the
    server's)."""

    __slots__ = ("__weakref__", "_storage", "address", "layout", "owners")

    def __init__(self, layout: Layout) -> None:
        self.layout = layout  # of the tensor the views came from: its extent is the storage's size
        self.address: int | None = None
        self._storage: weakref.ref[Any] | None = None  # the storage object while one is alive
        self.owners: weakref.WeakSet[Any] = weakref.WeakSet()

    def storage_on(self, device: torch.device, owner: Any) -> Any:
        """The storage object (made again at the same address if the last is gone), `owner` (a
        tensor's handle) remembered as one that names it."""
        if owner is not None:
            self.owners.add(owner)
        storage = self._storage() if self._storage is not None else None
        if storage is None:
            nbytes = _nbytes(self.layout)
            if self.address is None:
                self.address = _address(nbytes)
                _by_address[self.address] = self
            storage = torch._C._construct_storage_from_data_pointer(self.address, device, nbytes)
            # it names this (`named_by`) and, held alone, keeps it and a tensor of the server's storage
            # alive, as a CPU storage keeps its memory; this holds it weakly and the tensors that asked
            # for it strongly (no cycle: a tensor's memory goes when the tensor does, not at the next
            # cycle collection), so it is one object while any of them lives, as on the CPU
            storage._genie_keeps = (self, self.owner())  # type: ignore[attr-defined]
            _instead_of_raw_memory(storage)
            self._storage = weakref.ref(storage)
        return storage

    def owner(self) -> Any:
        """A handle of a live tensor that names this storage, or None."""
        return next(iter(self.owners), None)


def _instead_of_raw_memory(storage: Any) -> None:
    """The storage methods that would read or allocate memory at its address in this process, done
    on the device instead (PyTorch's would crash the process), or refused in words."""
    device = storage.device
    storage.new = lambda: torch.UntypedStorage(0, device=device)
    storage._byteswap = functools.partial(_byteswap, weakref.ref(storage))
    storage.resize_ = _no_resize  # (PyTorch's asks C++ hooks a Python-defined device has not)
    storage.cpu = functools.partial(_to_cpu, weakref.ref(storage))  # (torch.save writes what it gives)


def _no_resize(nbytes: int) -> None:
    raise RuntimeError(
        f"a {DEVICE_TYPE} storage cannot be resized in place; resize a tensor of it (t.resize_(...)), whose "
        "storage grows as on the CPU"
    )


def _to_cpu(storage: weakref.ref[Any]) -> Any:
    """`storage.cpu()`: its bytes fetched from the server, in a CPU storage of their own."""
    alive: Any = storage()  # (the storage whose method this is: alive while it is called)
    return torch.empty(0, dtype=torch.uint8, device=alive.device).set_(alive).cpu().untyped_storage()


def _byteswap(storage: weakref.ref[Any], element_size: int) -> None:
    """`storage.byteswap(dtype)`: each element's bytes reversed, by ops on the device."""
    alive: Any = storage()  # (the storage whose method this is: alive while it is called)
    raw = torch.empty(0, dtype=torch.uint8, device=alive.device).set_(alive)
    raw.copy_(raw.view(-1, element_size).flip(-1).reshape(-1))


def as_remote(t: Any) -> Any:
    """A plain tensor that PyTorch's C++ made over a remote tensor's storage (writing a storage to a
    file, pickling one): the remote tensor it stands for; anything else as it is."""
    if type(t) is not torch.Tensor or t.device.type != DEVICE_TYPE:  # (a remote tensor is of a subclass)
        return t
    made = torch.empty(0, dtype=t.dtype, device=t.device)
    return made.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def register() -> None:
    """`torch.UntypedStorage(n or bytes, device="remote_accelerator")`, and what makes one (a
    storage's `clone()`, a typed storage's casts): a remote tensor's storage, as CUDA gives a device
    storage. PyTorch's constructor asks the device for an allocator, which a device defined in Python
    has not, and crashes the process. A slice of one (`s[i:j]`) is refused in words: PyTorch's
    names memory inside it, which would be read as the whole storage or as none."""
    plain: Any = torch.UntypedStorage.__new__

    def __new__(cls: type, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is not None and cls is torch.UntypedStorage and not kwargs:
            where = torch.device(device)
            if where.type == DEVICE_TYPE:
                if len(args) > 1:
                    raise TypeError(f"torch.UntypedStorage(): one size or sequence of bytes, got {len(args)} arguments")
                if not args or hasattr(args[0], "__index__"):
                    made = torch.empty(operator.index(args[0]) if args else 0, dtype=torch.uint8, device=where)
                elif isinstance(args[0], (bytes, bytearray, memoryview)):
                    made = torch.frombuffer(bytearray(args[0]), dtype=torch.uint8).to(where)
                else:
                    made = torch.tensor(list(args[0]), dtype=torch.uint8, device=where)
                return made.untyped_storage()
        return plain(cls, *args, **kwargs) if device is None else plain(cls, *args, device=device, **kwargs)

    torch.UntypedStorage.__new__ = __new__  # type: ignore[method-assign]
    item: Any = torch.UntypedStorage.__getitem__

    def __getitem__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.device.type == DEVICE_TYPE and args and isinstance(args[0], slice):
            raise RuntimeError(  # (PyTorch's makes a storage at an address inside this one's, named by none)
                f"a {DEVICE_TYPE} storage cannot be sliced (s[i:j]); slice a tensor of it instead: "
                "torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)[i:j]"
            )
        return item(self, *args, **kwargs)

    torch.UntypedStorage.__getitem__ = __getitem__  # type: ignore[method-assign]


def named_by(storage: Any) -> SharedStorage | None:
    """The shared storage a storage object is (from a remote tensor's `untyped_storage()`, or one
    PyTorch's C++ made at its address: writing a storage to a file), or None."""
    keeps = getattr(storage, "_genie_keeps", None)
    return keeps[0] if keeps is not None else _by_address.get(storage.data_ptr())


def of(tensor: Any) -> SharedStorage:
    """`tensor`'s shared storage, made for it if it has none yet."""
    shared = tensor.__dict__.get("_shared")
    if shared is None:
        shared = tensor._shared = SharedStorage(tensor._layout)
        handle = tensor.__dict__.get("_handle")
        if handle is not None:  # (the tensor the views come from names it while it lives)
            shared.owners.add(handle)
    return shared


def grown(tensor: Any) -> None:
    """After an op laid `tensor` out anew (`resize_`, an `out=` that grows): a storage it names that
    is now too small is made again at the new size (PyTorch's grows, its address moving as memory
    reallocated does); the old storage object keeps its size, and names the same server storage."""
    shared = tensor.__dict__.get("_shared")
    if shared is not None and _nbytes(tensor._layout) > _nbytes(shared.layout):
        shared.layout = tensor._layout
        if shared.address is not None:  # (a storage object made already: the next is made at a new address)
            shared.address, shared._storage = None, None


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


def share(view: Any, source: Any) -> None:
    """`view` (a remote tensor an op just made, or one `set_` or `.data =` pointed elsewhere) names
    the storage of `source`: a remote tensor, or a storage object one gave (a storage of another
    device's leaves `view` as it is)."""
    if not isinstance(source, torch.UntypedStorage):
        view._shared = of(source)
        return
    shared = named_by(source)
    if shared is None and source.device.type == DEVICE_TYPE:  # bytes torch.load tagged for the device:
        # every view loaded from them names one storage, as they did where they were saved
        shared = SharedStorage(layout_of(torch.uint8, (source.nbytes(),), (1,), 0))
        source._genie_keeps = (shared, None)  # type: ignore[attr-defined]
    if shared is not None:
        view._shared = shared
