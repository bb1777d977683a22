"""How recorded ops are written down: references to remote tensors, and the remote device,
as small placeholders that the worker swaps for its own tensors and device."""

from __future__ import annotations

from typing import Any


class Ref:
    """A remote tensor, by id, inside a recorded op's arguments."""

    __slots__ = ("id",)

    def __init__(self, rid: int) -> None:
        self.id = rid

    def __reduce__(self) -> tuple[Any, ...]:
        return (Ref, (self.id,))

    def __repr__(self) -> str:
        return f"Ref({self.id})"


class RemoteDevice:
    """`remote_accelerator:N` inside an op's arguments: the worker's own device."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteDevice, ())


class StorageOf:
    """A remote tensor's storage inside an op's arguments (`set_`)."""

    __slots__ = ("ref",)

    def __init__(self, ref: Ref) -> None:
        self.ref = ref

    def __reduce__(self) -> tuple[Any, ...]:
        return (StorageOf, (self.ref,))


class MemoryFormat:
    """`torch.preserve_format` and friends: they pickle by a name that pickle looks up by scanning
    sys.modules, which can land on the notebook's `__main__`; send the plain name instead."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (MemoryFormat, (self.name,))


def encode_value(value: Any) -> Any:
    """A non-tensor argument, made safe to pickle for the worker."""
    import torch

    if isinstance(value, torch.memory_format):
        return MemoryFormat(str(value).removeprefix("torch."))
    return value


# Op records, in order: (kind, ...) tuples.
#   ("op", name, args, kwargs, out_ids)   run torch.ops.<name>, store tensor outputs under out_ids
#   ("put", id, tensor)                   a CPU tensor uploaded by the client (its bytes travel out of band)
#   ("free", id)                          the client dropped its last reference
#   ("seed", value)                       torch.manual_seed on the worker
