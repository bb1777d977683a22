"""Values as (a small JSON description, raw buffers).

Tensors and arrays travel as their raw bytes, never pickled; plain scalars and strings as
JSON; other objects go through cloudpickle (protocol 5), with large buffers inside them sent
out of band. A receiver that did not ask for arbitrary objects refuses pickles (`allow_pickle`).
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle


def _is_tensor(obj: Any) -> bool:
    """torch tensors, and remote_accelerator tensors (their values travel; they arrive as tensors)."""
    kind = type(obj)
    return (kind.__module__.startswith("torch") and kind.__name__ in ("Tensor", "Parameter")) or (
        kind.__module__ == "genie_core.remote_tensor.tensor" and kind.__name__ == "RemoteTensor"
    )


def _is_ndarray(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray"


def serialize(obj: Any) -> tuple[dict[str, Any], list[Any]]:
    if _is_tensor(obj):
        import torch

        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg()
        flat = t.contiguous().reshape(-1)
        if flat.numel() and flat.stride(0) != 1:  # size-1 dims with odd strides (an expanded scalar)
            flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
        data = flat.view(torch.uint8).numpy() if flat.numel() else b""
        return tensor_meta(obj), [memoryview(data).cast("B") if len(data) else b""]
    if _is_ndarray(obj) and not obj.dtype.hasobject:
        import numpy as np

        arr = np.ascontiguousarray(obj)
        return {"kind": "ndarray", "dtype": arr.dtype.str, "shape": list(arr.shape)}, [
            arr.reshape(-1).view(np.uint8).data if arr.size else b""
        ]
    if obj is None or type(obj) in (bool, int, float, str):
        return {"kind": "plain", "value": obj}, []
    oob: list[Any] = []
    data = cloudpickle.dumps(obj, protocol=5, buffer_callback=oob.append)
    return {"kind": "pickle", "n": len(oob)}, [data, *(b.raw() for b in oob)]


def tensor_meta(t: Any) -> dict[str, Any]:
    """A tensor's description; its bytes travel in C order (serialize)."""
    return {
        "kind": "tensor",
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "requires_grad": bool(t.requires_grad),
    }


def deserialize(meta: dict[str, Any], buffers: list[Any], device: str | None = None, allow_pickle: bool = True) -> Any:
    kind = meta.get("kind")
    if kind == "plain":
        value = meta.get("value")
        if value is not None and type(value) not in (bool, int, float, str):
            raise ValueError(f"not a plain value: {type(value).__name__}")
        return value
    if kind == "tensor":
        import torch

        dtype = getattr(torch, meta["dtype"])
        shape = meta["shape"]
        buf = buffers[0]
        if len(buf) == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # zmq frames are read-only views; we own them now
                t = torch.frombuffer(buf, dtype=torch.uint8)
                if t.data_ptr() % 16:  # complex128 kernels need 16-byte aligned memory: misaligned, they crash
                    t = t.clone()
                t = t.view(dtype).reshape(shape)
        if device:
            t = t.to(device)
        if meta.get("requires_grad"):
            t.requires_grad_(True)
        return t
    if kind == "ndarray":
        import numpy as np

        arr = (
            np.frombuffer(buffers[0], dtype=np.dtype(meta["dtype"]))
            if len(buffers[0])
            else np.empty(0, dtype=np.dtype(meta["dtype"]))
        )
        arr = arr.reshape(meta["shape"])
        return arr if arr.flags.writeable else arr.copy()
    if kind == "pickle":
        if not allow_pickle:
            from .errors import ProtocolError

            raise ProtocolError(
                f"refused a pickled object for {meta.get('name', 'a value')!r}: "
                "only tensors, arrays and plain values were asked for"
            )
        return pickle.loads(buffers[0], buffers=buffers[1:])
    raise ValueError(f"unknown value kind {kind!r}")


def serialize_namespace(
    values: dict[str, Any], each: Callable[[Any], tuple[dict[str, Any], list[Any]]] = serialize
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Many named values into one message: descriptions (with buffer counts) and all buffers.
    `each`: how one value is serialized (a worker leaves a GPU tensor's bytes on the GPU until they
    are sent: worker/host_copies.serialized)."""
    metas: list[dict[str, Any]] = []
    buffers: list[Any] = []
    for name, value in values.items():
        meta, bufs = each(value)
        meta["name"] = name
        meta["nbuf"] = len(bufs)
        metas.append(meta)
        buffers.extend(bufs)
    return metas, buffers


def deserialize_namespace(
    metas: list[dict[str, Any]], buffers: list[Any], device: str | None = None, allow_pickle: bool = True
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    i = 0
    for meta in metas:
        n = int(meta["nbuf"])
        out[meta["name"]] = deserialize(meta, buffers[i : i + n], device, allow_pickle)
        i += n
    return out
