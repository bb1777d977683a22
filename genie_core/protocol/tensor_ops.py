"""How remote-tensor ops are written down between the client that records them and the worker
that runs them: references to remote tensors and the remote device, as small placeholders that
the worker swaps for its own tensors and device, and CPU tensors uploaded by value."""

from __future__ import annotations

from typing import Any, TypeAlias

# A remote tensor, by id, inside a recorded op's arguments: the id's 8 bytes. No argument of an
# aten op (nor of a call record, nor a compiled graph's constant: fx_graph.py refuses bytes) is
# bytes, so bytes there always name a tensor. Bytes, unlike an object of a class, pickle without a
# call back into Python and are not tracked by the garbage collector: a record of such values (an
# op on tensors, numbers and tuples of them, nearly every op of a model) is untracked by the
# collector itself, so records waiting for a flush do not set off full collections
# (benchmarks/RESULTS.md, remote_tensors). (Named TensorRef, not Ref: a pickle of protocol 2 that
# names tensor_ops.Ref fails to load instead of reading as bytes.)
TensorRef: TypeAlias = bytes


def ref(rid: int) -> TensorRef:
    return rid.to_bytes(8, "little")


def ref_id(name: TensorRef) -> int:
    return int.from_bytes(name, "little")


class RemoteDevice:
    """`remote_accelerator:N` inside an op's arguments: the worker's own device."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteDevice, ())


class StorageOf:
    """A remote tensor's storage inside an op's arguments (`set_`)."""

    __slots__ = ("ref",)

    def __init__(self, tensor: TensorRef) -> None:
        self.ref = tensor

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


class HostTensor:
    """A CPU tensor sent with the ops: its bytes travel out of band (pickle protocol 5), in the
    tensor's own memory order, and become a tensor again when unpickled (strides kept)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any, snapshot: bool = True) -> None:
        """`snapshot`: copy the values now, so that later local changes do not leak in; without,
        the tensor's own memory is sent (when it is dense and whole: else it is copied), by a
        caller that sends it before the user's code can change it."""
        import torch

        t = tensor.detach().resolve_conj().resolve_neg()
        if t.layout != torch.strided:
            raise NotImplementedError(
                f"{t.layout} tensors are not supported on remote_accelerator; convert with .to_dense() first"
            )
        if t.is_quantized:
            raise NotImplementedError("quantized tensors are not supported on remote_accelerator")
        whole = t.is_contiguous() and not t.storage_offset() and t.untyped_storage().nbytes() == t.nbytes
        self.tensor = t if whole and not snapshot else t.clone()  # dense, offset 0

    def __reduce__(self) -> tuple[Any, ...]:
        import pickle

        t = self.tensor
        data = t.untyped_storage()
        raw = memoryview(torch_bytes(t)) if data.nbytes() else b""
        return (
            _rebuild_host_tensor,
            (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride(), pickle.PickleBuffer(raw)),
        )


class HostBytes:
    """Bytes [start, end) of a dense CPU tensor (HostTensor's), sent out of band with no copy: a
    part of a big upload. Unpickled as a flat uint8 tensor."""

    __slots__ = ("end", "start", "tensor")

    def __init__(self, tensor: Any, start: int, end: int) -> None:
        self.tensor, self.start, self.end = tensor, start, end

    def __reduce__(self) -> tuple[Any, ...]:
        import pickle

        raw = memoryview(torch_bytes(self.tensor))[self.start : self.end]
        return (_rebuild_host_bytes, (pickle.PickleBuffer(raw),))


def _rebuild_host_bytes(raw: Any) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only message frames: ours now
        return torch.frombuffer(raw, dtype=torch.uint8)


def torch_bytes(t: Any) -> Any:
    """The bytes of a dense tensor's storage, as a numpy uint8 array (no copy)."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()


# An upload smaller than this gets memory of its own where it is rebuilt (a copy of a message's
# bytes): memory that can grow, as a tensor made there can (`resize_`, an `out=` that grows). A bigger
# one is the memory it arrived in (a CPU server keeps a segment's bytes as they are).
OWN_MEMORY_BELOW = 64 << 10


def _rebuild_host_tensor(dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], raw: Any) -> Any:
    import warnings

    import torch

    if not len(memoryview(raw)):
        return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only message frames: ours now
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    if flat.data_ptr() % 16 or flat.numel() < OWN_MEMORY_BELOW:  # (complex128 kernels need aligned memory)
        flat = flat.clone()
    return flat.view(getattr(torch, dtype)).as_strided(shape, stride)


def encode_value(value: Any) -> Any:
    """A non-tensor argument, made safe to pickle for the worker."""
    import torch

    if isinstance(value, torch.memory_format):
        return MemoryFormat(str(value).removeprefix("torch."))
    return value


# The records these values travel in: protocol/op_records.py.
