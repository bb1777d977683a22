"""The worker side of remote tensors: replays a client's op stream on the worker's device and
keeps the resulting tensors, by id, until the client frees them."""

from __future__ import annotations

import gc
import importlib
import pickle
import time
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_loads

from ..errors import LimitExceeded, size_text
from ..protocol.contents import OpBatch, TensorReply
from ..protocol.tensor_ops import MemoryFormat, Ref, RemoteDevice, StorageOf
from ..serialize import serialize_namespace
from . import checkpoints, device_answers, kept_graphs
from .captured import CapturedGraph
from .compiled import CompiledGraphs
from .cpu_shims import CPU_SHIMS


class _Failed:
    """Stands for a tensor whose op failed, so later uses name the original failure."""

    def __init__(self, op: str, error: BaseException) -> None:
        self.op = op
        self.error = error


def _layout(t: torch.Tensor) -> tuple:
    """Shape, dtype, and the strides and offset that matter (not those of size-1 dims or empty tensors)."""
    if t.numel() == 0:
        return tuple(t.shape), t.dtype
    return (
        tuple(t.shape),
        t.dtype,
        tuple(s for n, s in zip(t.shape, t.stride(), strict=True) if n > 1),
        t.storage_offset(),
    )


def _agree(name: str, value: torch.Tensor, want: tuple, inputs: Any) -> torch.Tensor:
    """The output the client expects (shape, strides, offset, dtype from the op's meta kernel).
    Values laid out differently in a fresh tensor are copied into the expected layout; a different
    shape or dtype (or layout of a view) fails the op: guessing would give wrong results later."""
    shape, stride, offset, dtype = want
    if value.is_nested and value.dtype == dtype:  # nn.TransformerEncoder's fast path (the client sees it padded)
        return value
    if value.layout != torch.strided:
        raise NotImplementedError(
            f"it made a {value.layout} tensor: sparse and other non-strided layouts are not "
            "supported on remote_accelerator"
        )
    if value.dtype == dtype and value.shape == shape and value.stride() == stride and value.storage_offset() == offset:
        return value
    expected = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if offset:
        expected = expected.as_strided(shape, stride, offset)
    if _layout(value) == _layout(expected):
        return value
    storages = {t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    if (
        value.dtype == dtype
        and tuple(value.shape) == shape
        and not offset
        and value.untyped_storage().data_ptr() not in storages
    ):
        return torch.empty_strided(shape, stride, dtype=dtype, device=value.device).copy_(value)
    raise RuntimeError(
        f"{name} gave a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)} "
        f"(strides {value.stride()}) "
        f"on the server where its meta kernel promised {str(dtype).removeprefix('torch.')} {shape} (strides {stride}): "
        "this op is not supported on remote_accelerator for these arguments"
    )


class HeldTensors(dict):
    """id -> tensor, counting the bytes of the distinct storages held (views share their base's)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_held = 0
        self._storages: dict[tuple[bool, int], list[int]] = {}  # (on a GPU, address) -> [bytes, users]

    @staticmethod
    def _key(value: Any) -> tuple[tuple[bool, int], int] | None:
        if not isinstance(value, torch.Tensor):
            return None
        storage = value.untyped_storage()
        address = storage.data_ptr()  # 0 for meta tensors and empty storages
        return ((value.is_cuda, address), storage.nbytes()) if address else None

    def __setitem__(self, rid: int, value: Any) -> None:
        if rid in self:
            self.pop(rid, None)
        super().__setitem__(rid, value)
        found = self._key(value)
        if found is not None:
            entry = self._storages.setdefault(found[0], [found[1], 0])
            if entry[1] == 0:
                self.bytes_held += entry[0]
            entry[1] += 1

    def pop(self, rid: int, default: Any = None) -> Any:
        value = super().pop(rid, default)
        found = self._key(value)
        if found is not None and found[0] in self._storages:
            entry = self._storages[found[0]]
            entry[1] -= 1
            if entry[1] <= 0:
                del self._storages[found[0]]
                self.bytes_held -= entry[0]
        return value


class UncountedTensors(dict):
    """id -> tensor, when no byte limit needs the count (it costs a storage lookup per tensor)."""

    bytes_held = 0


def _note_time(timing: dict[str, list[float]], record: tuple, since: float) -> None:
    name = record[1] if record[0] in ("op", "call") else record[0]
    entry = timing.setdefault(name, [0.0, 0])
    entry[0] += time.perf_counter() - since
    entry[1] += 1


_PLACEHOLDERS = frozenset({Ref, RemoteDevice, StorageOf, MemoryFormat})
_NESTED = frozenset({tuple, list, dict})


class TensorExecutor:
    def __init__(self, max_tensors: int = 1_000_000, max_bytes: int | None = None) -> None:
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.store: HeldTensors | UncountedTensors = HeldTensors() if max_bytes is not None else UncountedTensors()
        self.max_tensors, self.max_bytes = max_tensors, max_bytes
        self.ops_run = 0
        self.clocks: dict[int, Any] = {}  # Event(enable_timing=True) readings, by id (device_answers.py)
        self._ops: dict[str, Any] = {}
        self.graphs = CompiledGraphs(self.device, self.store)
        self.graph_memory: dict[int, torch.Tensor] = {}  # what captured graphs made (captured.py)
        self.graph_of: dict[int, CapturedGraph] = {}  # the captured graph that makes an id
        gc.freeze()  # what this worker imported lives as long as it does: keep it out of every collection

    @property
    def bytes_held(self) -> int:
        return self.store.bytes_held

    def _held_bytes(self) -> int:
        """Bytes of the distinct storages the session's tensors hold."""
        if isinstance(self.store, HeldTensors):
            return self.store.bytes_held
        storages = {}
        for value in self.store.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        storages.pop(0, None)
        return sum(storages.values())

    def _check_limits(self, made: str) -> None:
        """After an op stored its outputs: over a limit, the op fails (and its outputs are dropped)."""
        if len(self.store) > self.max_tensors:
            raise LimitExceeded(
                f"{made} would make this session hold {len(self.store):,} remote tensors; the server allows "
                f"{self.max_tensors:,} (--max-session-tensors): free some (del)"
            )
        if self.max_bytes is not None and self.store.bytes_held > self.max_bytes:
            raise LimitExceeded(
                f"{made} would make this session hold {size_text(self.store.bytes_held)} in remote tensors; the server "
                f"allows {size_text(self.max_bytes)} (--max-session-bytes): free some (del)"
            )

    def _resolve_all(self, values: Any) -> Any:
        """Arguments as recorded (tuples and lists one level deep, a kwargs dict) with their
        placeholders replaced; much faster than a general tree map, and this runs for every op."""
        kind = type(values)
        if kind is tuple or kind is list:
            return kind([self._one(v) for v in values])
        if kind is dict:
            return {k: self._one(v) for k, v in values.items()} if values else values
        return self._one(values)

    def _one(self, v: Any) -> Any:
        kind = type(v)
        if kind is Ref:
            t = self.store.get(v.id)
            if t is None or type(t) is _Failed:
                return self._resolve(v)  # raises, saying why
            return t
        if kind in _NESTED:
            return self._resolve_all(v)
        if kind in _PLACEHOLDERS:
            return self._resolve(v)
        return v

    def _resolve(self, value: Any) -> Any:
        if isinstance(value, Ref):
            t = self.store.get(value.id)
            if t is None:
                t = self.graph_memory.get(value.id)  # a captured graph's, that the client let go
            if t is None:
                raise RuntimeError(
                    f"remote tensor {value.id} does not exist on the server (freed, or made in another session)"
                )
            if isinstance(t, _Failed):
                raise RuntimeError(f"depends on a remote op that failed earlier: {t.op}: {t.error}") from t.error
            return t
        if isinstance(value, RemoteDevice):
            return self.device
        if isinstance(value, StorageOf):
            return self._resolve(value.ref).untyped_storage()
        if isinstance(value, MemoryFormat):
            return getattr(torch, value.name)
        return value

    def run(self, frames: list[Any]) -> tuple[TensorReply, list[Any]]:
        """frames: [pickled request, out-of-band buffers...]. Returns the reply content and buffers."""
        start = time.perf_counter()
        collecting = gc.isenabled()
        gc.disable()  # thousands of small objects per batch: no cycle collection pauses in the middle
        try:
            return self._run(frames, start)
        finally:
            if collecting:
                gc.enable()

    def _run(self, frames: list[Any], start: float) -> tuple[TensorReply, list[Any]]:
        request: OpBatch = pickle.loads(frames[0], buffers=frames[1:])
        failure: dict[str, Any] | None = None
        eager: Any = None
        records = request["ops"]
        timing: dict[str, list[float]] | None = {} if request.get("profile") else None  # op -> [seconds, calls]
        tick = start
        for index, record in enumerate(records):
            kind = record[0]
            if timing is not None:
                if index:
                    _note_time(timing, records[index - 1], tick)
                tick = time.perf_counter()
            if kind == "free" or kind == "fail":  # (even after a failure)
                self.step(record)
                continue
            if failure is not None:  # skip the rest, poisoning what they would have made
                self._poison(record, failure["op"], failure["error"])
                continue
            try:
                out = self.step(record)
                if request.get("eager_last") and index == len(records) - 1:
                    if kind in ("ask", "load", "read"):
                        eager = {"value": out}
                    elif kind == "op":
                        eager = self._describe(out, record[4])
            except Exception as exc:
                failure = {"op": record[1] if kind in ("op", "call") else kind, "index": index, "error": exc}
                self._poison(record, record[1] if kind in ("op", "call") else kind, exc)
            self.ops_run += 1
        if self.device.type == "cuda" and request.get("sync"):
            torch.cuda.synchronize()
        content: TensorReply = {
            "status": "ok",
            "eager": eager,
            "stored": len(self.store),
            "run_s": time.perf_counter() - start,
        }
        if timing is not None:
            if records:
                _note_time(timing, records[-1], tick)
            content["profile"] = timing
        if failure is not None:
            error = failure["error"]
            content = {
                "status": "error",
                "op": failure["op"],
                "index": failure["index"],
                "ename": type(error).__name__,
                "evalue": str(error),
                "stored": len(self.store),
            }
            return content, []
        fetch = {}
        for rid in request.get("fetch", []):
            value = self._resolve(Ref(rid))
            fetch[str(rid)] = value
        metas, buffers = serialize_namespace(fetch)
        content["fetch"] = metas
        return content, buffers

    def _poison(self, record: tuple, op: str, error: BaseException) -> None:
        """What a record that failed, or was skipped after a failure, would have made: later uses
        name the failure."""
        kind = record[0]
        if kind == "put":
            self.store[record[1]] = _Failed("put", error)
        elif kind in ("op", "call") and not isinstance(record[4], range):  # (a range: a list op's ids)
            for rid in record[4]:
                if rid is not None:
                    self.store[rid] = _Failed(op, error)
        elif kind == "capture":
            for inner in record[2]:
                self._poison(inner, op, error)

    def step(self, record: tuple) -> Any:
        """Run one record (a "free" or "fail" too, for captured graphs' lists): what an op made, or a
        question's answer."""
        kind = record[0]
        if kind == "op":
            out = self._run_op(record)
            self._check_limits(f"remote op {record[1]}")
            return out
        if kind == "free":
            found = self.store.pop(record[1], None)
            if type(found) is CapturedGraph:
                found.release()
            owner = self.graph_of.get(record[1]) if self.graph_of else None
            if owner is not None:
                owner.dropped.add(record[1])
            if self.clocks:
                self.clocks.pop(record[1], None)
        elif kind == "call":
            self._run_call(record)
            self._check_limits(f"remote call {record[1]}")
        elif kind == "put":
            self.store[record[1]] = record[2].to(self.device)
            self._check_limits("a tensor sent from here")
        elif kind == "fail":  # outputs of an op that failed on the client during backward
            for rid in record[1]:
                self.store[rid] = _Failed(record[2], RuntimeError(record[3]))
        elif kind == "seed":  # (torch.manual_seed also visits every other device type: milliseconds)
            torch.default_generator.manual_seed(record[1])
            if self.device.type == "cuda":
                torch.cuda.manual_seed(record[1])
        elif kind == "rng_get":
            self.store[record[1]] = (
                torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()
            )
        elif kind == "rng_set":
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(record[1], self.device)
            else:
                torch.set_rng_state(record[1])
        elif kind == "graph":  # a graph torch.compile captured on the client, by content hash
            self.graphs.define(record[1], record[2], record[3])
        elif kind == "capture":  # ops captured as a graph (torch.remote_accelerator.graph): kept to replay
            self.store[record[1]] = CapturedGraph(self, record[2])
        elif kind == "replay":
            found = self.store.get(record[1])
            if not isinstance(found, CapturedGraph):
                raise RuntimeError("this captured graph is not on the server (reset, or captured in another session)")
            found.replay()
        elif kind == "import":  # the module that defines a custom op used here (torch.library)
            importlib.import_module(record[1])
        elif kind == "clock":
            self.clocks[record[1]] = device_answers.clock(self.device)
        elif kind == "ask":
            return device_answers.answer(record[1], record[2], self.device, self._held_bytes, self.clocks)
        elif kind == "load":  # a checkpoint on this machine's disk (torch.remote_accelerator.load)
            leaves, spec = checkpoints.load(record[2], self.device)
            ids = range(record[1], record[1] + len(leaves))
            for rid, leaf in zip(ids, leaves, strict=True):
                if isinstance(leaf, torch.Tensor):
                    self.store[rid] = leaf
            self._check_limits(f"the checkpoint {record[2]}")
            return {"spec": spec, "leaves": [_described(rid, leaf) for rid, leaf in zip(ids, leaves, strict=True)]}
        elif kind == "read":  # a small text file on this machine's disk (a model's config.json)
            return checkpoints.read_text(record[1])
        return None

    def adopt(self, graph: CapturedGraph) -> None:
        """A captured graph's memory is readable by every graph, and its ids' frees are told to it."""
        self.graph_memory.update(graph.memory)
        for rid in graph.made:
            self.graph_of[rid] = graph

    def _run_op(self, record: tuple) -> Any:
        name, args, kwargs, out_ids = record[1:5]
        expect = record[5] if len(record) > 5 else None
        func = self._ops.get(name)
        if func is None:
            namespace, op, overload = name.split(".")
            try:
                func = getattr(getattr(getattr(torch.ops, namespace), op), overload)
            except AttributeError:
                raise RuntimeError(f"the server's torch {torch.__version__} has no op {name}") from None
            if self.device.type == "cpu":
                func = CPU_SHIMS.get(name, func)
            self._ops[name] = func
        args = self._resolve_all(args)
        out = func(*args, **self._resolve_all(kwargs)) if kwargs else func(*args)
        if type(out) is torch.Tensor and len(out_ids) == 1:  # the common case: one tensor out
            rid = out_ids[0]
            if rid is not None:
                self.store[rid] = (
                    out if expect is None or expect[0] is None else _agree(name, out, expect[0], (args, kwargs))
                )
            return out
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        # out_ids of an op run eagerly is a block of ids (a range) for a list of unknown length
        for i, (rid, value) in enumerate(zip(out_ids, outputs, strict=False)):
            if rid is None:
                continue
            if expect is not None and expect[i] is not None and isinstance(value, torch.Tensor):
                value = _agree(name, value, expect[i], (args, kwargs))
            elif isinstance(value, torch.Tensor) and value.layout != torch.strided:
                raise NotImplementedError(
                    f"it made a {value.layout} tensor: sparse and other non-strided layouts are not "
                    "supported on remote_accelerator"
                )
            self.store[rid] = value
        return out

    def _run_call(self, record: tuple) -> None:
        _, name, args, kwargs, out_ids, expect = record
        args, kwargs = self._resolve_all(args), self._resolve_all(kwargs)
        if name == "graph":
            outs = self.graphs.run(kwargs["key"], args, kwargs["graph"], kwargs["needs"])
        else:
            outs = run_call(name, args, kwargs, self.store)
        for i, (rid, value) in enumerate(zip(out_ids, outs, strict=True)):
            if rid is not None:
                self.store[rid] = _agree(name, value, expect[i], (args, kwargs))

    def _describe(self, out: Any, out_ids: list[int | None]) -> Any:
        """Shapes and plain values of an op run eagerly (its output shape depended on data)."""
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        described = []
        for rid, value in zip(out_ids, outputs, strict=False):  # out_ids may be a longer block of ids
            if isinstance(value, torch.Tensor) and value.layout != torch.strided:
                raise NotImplementedError(
                    f"it made a {value.layout} tensor: sparse and other non-strided layouts are not "
                    "supported on remote_accelerator"
                )
            described.append(_described(rid, value))
        return {"outputs": described, "tuple": isinstance(out, (tuple, list))}


def _described(rid: int | None, value: Any) -> dict[str, Any]:
    """A tensor as the client makes its remote tensor from it (its id and layout), or a plain value."""
    if not isinstance(value, torch.Tensor):
        return {"value": value}
    return {
        "id": rid,
        "shape": list(value.shape),
        "stride": list(value.stride()),
        "offset": value.storage_offset(),
        "dtype": str(value.dtype).removeprefix("torch."),
    }


def run_call(name: str, args: tuple, kwargs: dict, store: Any) -> list[Any]:
    """The server's own functions a client records as one call: the attention forward (keeping its
    graph under `graph`) or backward (see genie_core/remote_tensor/attention.py)."""
    if name == "sdpa":
        graph, needs = kwargs.pop("graph"), kwargs.pop("needs")
        query, key, value, mask = args
        if graph is None:
            with torch.no_grad():
                return [torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, **kwargs)]
        inputs = [
            t.detach().requires_grad_(n) if isinstance(t, torch.Tensor) else t for t, n in zip(args, needs, strict=True)
        ]
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                inputs[0], inputs[1], inputs[2], attn_mask=inputs[3], **kwargs
            )
        store[graph] = (out, inputs, needs)
        return [out.detach()]
    if name == "sdpa_backward":
        graph, grad_out = args
        found = store.get(graph)
        if not isinstance(found, tuple):
            raise RuntimeError(
                "the attention graph for this backward is gone (backward through it twice without retain_graph?)"
            )
        out, inputs, needs = found
        grads = iter(
            torch.autograd.grad(out, [t for t, n in zip(inputs, needs, strict=True) if n], grad_out, retain_graph=True)
        )
        return [next(grads) if n else None for n in needs]
    if name == "aten":
        return _run_whole(args, kwargs, store)
    if name == "aten_backward":
        graph, grads = args
        return kept_graphs.backward(store, graph, grads, kwargs.get("retain", True))
    raise ValueError(f"unknown server call {name!r}")


_specs: dict[str, Any] = {}


def _spec(text: str) -> Any:
    found = _specs.get(text)
    if found is None:
        found = _specs[text] = treespec_loads(text)
    return found


def _run_whole(args: tuple, kwargs: dict, store: Any) -> list[Any]:
    """An aten op run whole with this device's kernels (genie_core/remote_tensor/whole_ops.py),
    keeping its graph under `graph` for the backward when a gradient is wanted."""
    graph, needs = kwargs["graph"], kwargs["needs"]
    packet, overload = kwargs["op"].removeprefix("aten.").split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)
    leaves, spec = list(args), _spec(kwargs["spec"])
    if graph is None:
        with torch.no_grad():
            op_args, op_kwargs = tree_unflatten(leaves, spec)
            out = op(*op_args, **op_kwargs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def run(leaves: list[Any]) -> Any:
        call_args, call_kwargs = tree_unflatten(leaves, spec)
        return op(*call_args, **call_kwargs)

    return kept_graphs.run_keeping_graph(run, leaves, needs, graph, store)
