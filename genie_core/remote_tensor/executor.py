"""The worker side of remote tensors: replays a client's op stream on the worker's device and
keeps the resulting tensors, by id, until the client frees them."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..serialize import serialize_namespace
from .ops import MemoryFormat, Ref, RemoteDevice


class _Failed:
    """Stands for a tensor whose op failed, so later uses name the original failure."""

    def __init__(self, op: str, error: BaseException) -> None:
        self.op = op
        self.error = error


class TensorExecutor:
    def __init__(self) -> None:
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.store: dict[int, Any] = {}
        self.ops_run = 0

    def _resolve(self, value: Any) -> Any:
        if isinstance(value, Ref):
            t = self.store.get(value.id)
            if t is None:
                raise RuntimeError(f"remote tensor {value.id} does not exist on the server (freed, or made in another session)")
            if isinstance(t, _Failed):
                raise RuntimeError(f"depends on a remote op that failed earlier: {t.op}: {t.error}") from t.error
            return t
        if isinstance(value, RemoteDevice):
            return self.device
        if isinstance(value, MemoryFormat):
            return getattr(torch, value.name)
        return value

    def run(self, frames: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        """frames: [pickled request, out-of-band buffers...]. Returns the reply content and buffers."""
        request = pickle.loads(frames[0], buffers=frames[1:])
        failure: dict[str, Any] | None = None
        eager: Any = None
        records = request["ops"]
        for index, record in enumerate(records):
            kind = record[0]
            if kind == "free":
                self.store.pop(record[1], None)
                continue
            if failure is not None:  # skip the rest, poisoning what they would have made
                if kind == "op":
                    for rid in record[4]:
                        if rid is not None:
                            self.store[rid] = _Failed(failure["op"], failure["error"])
                continue
            try:
                if kind == "put":
                    self.store[record[1]] = record[2].to(self.device)
                elif kind == "seed":
                    torch.manual_seed(record[1])
                elif kind == "op":
                    out = self._run_op(record)
                    if request.get("eager_last") and index == len(records) - 1:
                        eager = self._describe(out, record[4])
            except Exception as exc:
                failure = {"op": record[1] if kind == "op" else kind, "index": index, "error": exc}
                if kind == "op":
                    for rid in record[4]:
                        if rid is not None:
                            self.store[rid] = _Failed(record[1], exc)
            self.ops_run += 1
        if self.device.type == "cuda" and request.get("sync"):
            torch.cuda.synchronize()
        content: dict[str, Any] = {"status": "ok", "eager": eager, "stored": len(self.store)}
        if failure is not None:
            error = failure["error"]
            content = {"status": "error", "op": failure["op"], "index": failure["index"],
                       "ename": type(error).__name__, "evalue": str(error), "stored": len(self.store)}
            return content, []
        fetch = {}
        for rid in request.get("fetch", []):
            value = self._resolve(Ref(rid))
            fetch[str(rid)] = value
        metas, buffers = serialize_namespace(fetch)
        content["fetch"] = metas
        return content, buffers

    def _run_op(self, record: tuple) -> Any:
        _, name, args, kwargs, out_ids = record
        namespace, op, overload = name.split(".")
        func = getattr(getattr(getattr(torch.ops, namespace), op), overload)
        out = func(*tree_map(self._resolve, args), **tree_map(self._resolve, kwargs))
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        for rid, value in zip(out_ids, outputs):
            if rid is not None:
                self.store[rid] = value
        return out

    def _describe(self, out: Any, out_ids: list[int | None]) -> Any:
        """Shapes and plain values of an op run eagerly (its output shape depended on data)."""
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        described = []
        for rid, value in zip(out_ids, outputs):
            if isinstance(value, torch.Tensor):
                described.append({"id": rid, "shape": list(value.shape), "stride": list(value.stride()),
                                  "offset": value.storage_offset(), "dtype": str(value.dtype).removeprefix("torch.")})
            else:
                described.append({"value": value})
        return {"outputs": described, "tuple": isinstance(out, (tuple, list))}
