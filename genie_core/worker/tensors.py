"""The worker side of remote tensors: replays a client's op stream on the worker's device and
keeps the resulting tensors, by id, until the client frees them."""

from __future__ import annotations

import gc
import importlib
import pickle
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn, cast

import torch
from torch.utils._pytree import tree_flatten

from ..errors import LimitExceeded, MemoryLimitExceeded, size_text
from ..protocol.contents import OpBatch, TensorReply
from ..protocol.op_records import CallRecord, Expect, Expects, OpRecord, Record, name_of, written_values
from ..protocol.tensor_ops import MemoryFormat, RemoteDevice, StorageOf, TensorRef, ref_id
from ..serialize import serialize_namespace
from . import checkpoints, custom_ops, device_answers, host_copies, numerics
from .captured import CapturedGraph
from .compiled import CompiledGraphs
from .cpu_shims import CPU_SHIMS
from .held import HeldTensors, UncountedTensors
from .server_calls import run_call


class _Failed:
    """Stands for a tensor whose op failed, so later uses name the original failure."""

    def __init__(self, op: str, error: BaseException) -> None:
        self.op = op
        self.error = error


class _FailedEarlier(RuntimeError):
    """An op's argument is a tensor whose op failed: the op fails too, naming that failure."""

    def __init__(self, failed: _Failed) -> None:
        super().__init__(f"depends on a remote op that failed earlier: {failed.op}: {failed.error}")
        self.failed = failed
        self.__cause__ = failed.error


def error_kind(exc: BaseException) -> str:
    """The kind an error is reported as: one that depends on an earlier failure is of that
    failure's kind (`except IndexError:` catches both, as it would have caught the first)."""
    return type(exc.failed.error if isinstance(exc, _FailedEarlier) else exc).__name__


def _poison(store: Any, record: Record, failed: _Failed, kept: Any = ()) -> None:
    """What a record that failed would have made or written in place: later uses name the first
    failure. A target is not known to be as it was: PyTorch may have begun to write it (`resize_`
    sets the new shape before it finds the storage cannot grow: read, it would crash the worker),
    or, failing for want of a tensor whose op failed, it never got the write the notebook believes
    it did. But `kept`: the targets of an op whose failure the notebook is told at the op (it ran
    at once, and failed first), laid out as they were: as on the CPU, they are as the kernel left
    them (most often untouched: kernels check their arguments first)."""
    if record[0] == "put" or record[0] == "part":
        store[record[1]] = failed  # (its own: an upload depends on nothing)
    elif record[0] == "op" or record[0] == "call":
        out_ids = record[4]
        if not isinstance(out_ids, range):  # (a range: a list op's block of ids)
            for rid in out_ids:
                if rid is not None:
                    store[rid] = failed
        if record[0] == "op":
            for rid in _written(record):
                if rid in store and rid not in kept:
                    store[rid] = failed
    elif record[0] == "capture":
        for inner in record[2]:
            _poison(store, inner, failed)


def _targets(store: Any, record: Record) -> list[tuple[int, Any, tuple]]:
    """The tensors an op is about to write, each with its layout and storage (none known for a
    tensor without strides or storage: a nested one)."""
    found = [(rid, store.get(rid)) for rid in _written(cast(OpRecord, record))]
    try:
        return [
            (rid, t, (_layout(t), t.untyped_storage().data_ptr())) for rid, t in found if isinstance(t, torch.Tensor)
        ]
    except (RuntimeError, NotImplementedError):
        return []


def _as_they_were(store: Any, targets: list[tuple[int, Any, tuple]]) -> set[int]:
    """The ids of those still laid out as they were, over the same storage."""
    return {
        rid for rid, t, was in targets if store.get(rid) is t and (_layout(t), t.untyped_storage().data_ptr()) == was
    }


def _written(record: OpRecord) -> list[int]:
    """The ids of the tensors an op writes in place: its schema's `Tensor(a!)` arguments."""
    _, name, args, kwargs, _, _ = record
    namespace, packet, overload = name.split(".")
    try:
        schema = getattr(getattr(getattr(torch.ops, namespace), packet), overload)._schema
    except AttributeError:  # (no such op here: it failed before it could write anything)
        return []
    return [ref_id(v) for v in written_values(schema, args, kwargs) if type(v) is TensorRef]


class _Failure(NamedTuple):
    """The first record of a batch that failed: its name, its place in the batch, the error."""

    op: str
    at: int
    error: BaseException


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


def _laid_out(value: torch.Tensor, want: Expect) -> bool:
    """Whether a tensor is exactly as the client expects it (as it nearly always is): _agree's test
    of the common case, by itself because it runs for every op."""
    try:
        return (
            value.dtype == want[3]
            and value.shape == want[0]
            and value.stride() == want[1]
            and value.storage_offset() == want[2]
        )
    except RuntimeError:  # a nested tensor has no strides: _agree says what to do
        return False


def _agree(name: str, value: torch.Tensor, want: Expect, inputs: Any) -> torch.Tensor:
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
    if _laid_out(value, want):
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
        f"(strides {value.stride()}, offset {value.storage_offset()}) on the server where its meta kernel promised "
        f"{str(dtype).removeprefix('torch.')} {shape} (strides {stride}, offset {offset}): "
        "this op is not supported on remote_accelerator for these arguments"
    )


Timing = dict[str, list[float]]  # a profiled batch's time by record name: [seconds, calls]


def _note_time(timing: Timing, record: Record, since: float) -> float:
    """Add the time since `since` to the record's name (a profiled batch); returns now."""
    now = time.perf_counter()
    entry = timing.setdefault(name_of(record), [0.0, 0])
    entry[0] += now - since
    entry[1] += 1
    return now


_PLACEHOLDERS = frozenset({TensorRef, RemoteDevice, StorageOf, MemoryFormat})
_NESTED = frozenset({tuple, list, dict})
_SWAPPED = _PLACEHOLDERS | _NESTED  # what _one replaces (or looks inside)


class TensorExecutor:
    def __init__(self, max_tensors: int = 1_000_000, max_bytes: int | None = None) -> None:
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.store: HeldTensors | UncountedTensors = HeldTensors() if max_bytes is not None else UncountedTensors()
        self.max_tensors, self.max_bytes = max_tensors, max_bytes
        self.clocks: dict[int, Any] = {}  # Event(enable_timing=True) readings, by id (device_answers.py)
        self._ops: dict[str, Any] = {}
        self.graphs = CompiledGraphs(self.device, self.store)
        self.graph_memory: dict[int, torch.Tensor] = {}  # what captured graphs made (captured.py)
        self.graph_of: dict[int, CapturedGraph] = {}  # the captured graph that makes an id
        self.relaid: set[str] = set()  # ops of the batch running whose output was not as the client promised
        self.lent = False  # the batch's uploads are in memory the client fills again: keep copies only
        gc.freeze()  # what this worker imported lives as long as it does: keep it out of every collection

    @property
    def bytes_held(self) -> int:
        return self.store.bytes_held

    def _check_limits(self, made: str) -> None:
        """After an op stored its outputs: over a limit, the op fails (and its outputs are dropped)."""
        if len(self.store) > self.max_tensors:
            raise LimitExceeded(
                f"{made} would make this session hold {len(self.store):,} remote tensors; the server allows "
                f"{self.max_tensors:,} (--max-session-tensors): free some (del)"
            )
        if self.max_bytes is not None and self.store.bytes_held > self.max_bytes:
            raise MemoryLimitExceeded(
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
        if kind is TensorRef:
            t = self.store.get(ref_id(v))
            if t is None or type(t) is _Failed:
                return self._resolve(v)  # raises, saying why
            return t
        if kind in _NESTED:
            return self._resolve_all(v)
        if kind in _PLACEHOLDERS:
            return self._resolve(v)
        return v

    def _held(self, rid: int) -> Any:
        """The tensor `rid` names, or why there is none."""
        t = self.store.get(rid)
        if t is None:
            t = self.graph_memory.get(rid)  # a captured graph's, that the client let go
        if t is None:
            raise RuntimeError(f"remote tensor {rid} does not exist on the server (freed, or made in another session)")
        if isinstance(t, _Failed):
            raise _FailedEarlier(t)
        return t

    def _resolve(self, value: Any) -> Any:
        if isinstance(value, TensorRef):
            return self._held(ref_id(value))
        if isinstance(value, RemoteDevice):
            return self.device
        if isinstance(value, StorageOf):
            return self._resolve(value.ref).untyped_storage()
        if isinstance(value, MemoryFormat):
            return getattr(torch, value.name)
        return value

    def run(self, frames: list[Any], lent: bool = False) -> tuple[TensorReply, list[Any]]:
        """frames: [pickled request, out-of-band buffers...]; `lent`: the buffers are memory the client
        fills again once this batch is answered (dataplane/lent.py). Returns the reply content and buffers."""
        start = time.perf_counter()
        collecting = gc.isenabled()
        gc.disable()  # thousands of small objects per batch: no cycle collection pauses in the middle
        self.lent = lent
        try:
            return self._run(frames, start)
        finally:
            self.lent = False
            if collecting:
                gc.enable()

    def _run(self, frames: list[Any], start: float) -> tuple[TensorReply, list[Any]]:
        request: OpBatch = pickle.loads(frames[0], buffers=frames[1:])
        numerics.take(request.get("numerics"))
        records: list[Record] = request["ops"]
        timing: Timing | None = {} if request.get("profile") else None
        self.relaid = set()
        failure: _Failure | None = None
        eager: Any = None
        answer = request.get("answer", -1)  # named by index: frees collected after it may follow it
        pop, graph_of, clocks = self.store.pop, self.graph_of, self.clocks
        tick, targets = start, []
        for index, record in enumerate(records):
            if timing is not None:
                tick = _note_time(timing, records[index - 1], tick) if index else time.perf_counter()
            # the two records of nearly every op, here rather than in step: the least Python per op
            if record[0] == "free":  # (even after a failure)
                found = pop(record[1], None)
                if graph_of or clocks or type(found) is CapturedGraph:
                    self._freed(record[1], found)
                continue
            try:  # (after a failure too: what does not depend on it runs, as the client believes it has)
                if index == answer and record[0] == "op":
                    targets = _targets(self.store, record)
                out = self._run_op(record) if record[0] == "op" else self.step(record)
                if index == answer:
                    eager = _answer(record, out)
            except Exception as exc:
                kept: Any = ()
                if failure is None:
                    failure = _Failure(name_of(record), index, exc)
                    if index == answer and record[0] == "op" and not isinstance(exc, _FailedEarlier):
                        kept = _as_they_were(self.store, targets)
                failed = exc.failed if isinstance(exc, _FailedEarlier) else _Failed(name_of(record), exc)
                _poison(self.store, record, failed, kept)
        if timing is not None and records:
            _note_time(timing, records[-1], tick)
        return self._reply(request, failure, start, eager, timing)

    def _reply(
        self,
        request: OpBatch,
        failure: _Failure | None,
        start: float,
        eager: Any,
        timing: Timing | None,
    ) -> tuple[TensorReply, list[Any]]:
        if self.device.type == "cuda" and request.get("sync"):
            torch.cuda.synchronize()
        if failure is not None:
            error = failure.error
            return {
                "status": "error",
                "op": failure.op,
                "index": failure.at,
                "ename": error_kind(error),
                "evalue": str(error),
                "stored": len(self.store),
            }, []
        content: TensorReply = {
            "status": "ok",
            "eager": eager,
            "stored": len(self.store),
            "run_s": time.perf_counter() - start,
        }
        if timing is not None:
            content["profile"] = timing
        if self.relaid:
            content["relaid"] = sorted(self.relaid)
        fetch = {str(rid): self._held(rid) for rid in request.get("fetch", [])}
        metas, buffers = serialize_namespace(fetch, each=host_copies.serialized)
        content["fetch"] = metas
        return content, buffers

    def _free(self, rid: int) -> None:
        self._freed(rid, self.store.pop(rid, None))

    def _freed(self, rid: int, found: Any) -> None:
        """What else a tensor's free lets go: a captured graph's resources, a graph's claim on the id,
        a timed event's reading."""
        if type(found) is CapturedGraph:
            found.release()
        if self.graph_of:
            owner = self.graph_of.get(rid)
            if owner is not None:
                owner.dropped.add(rid)
        if self.clocks:
            self.clocks.pop(rid, None)

    def step(self, record: Record) -> Any:
        """Run one record (captured graphs run theirs through here): what an op made, or a
        question's answer."""
        if record[0] == "op":
            return self._run_op(record)
        if record[0] == "free":
            self._free(record[1])
        elif record[0] == "call":
            self._run_call(record)
        elif record[0] == "put":
            _, rid, host = record
            uploaded = cast(torch.Tensor, host)  # (a HostTensor unpickles as a tensor)
            stored = host_copies.to_device(uploaded, self.device)
            self.store[rid] = stored.clone() if self.lent and stored is uploaded else stored  # (a CPU server's)
            self._check_limits("a tensor sent from here")
        elif record[0] == "part":
            _, rid, start, data, layout = record
            if layout is not None:  # the first part: the tensor made, then filled part by part
                shape, stride, dtype = layout
                self.store[rid] = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
                self._check_limits("a tensor sent from here")
            target = self.store.get(rid)
            if type(target) is torch.Tensor:  # (not if its first part failed: that failure names it)
                host_copies.bytes_into(cast(torch.Tensor, data), target, start)
        elif record[0] == "fail":  # outputs of an op that failed on the client during backward
            _, failed, op, message = record
            for rid in failed:
                self.store[rid] = _Failed(op, RuntimeError(message))
        elif record[0] == "seed":  # (torch.manual_seed also visits every other device type: milliseconds)
            seed = record[1]
            torch.default_generator.manual_seed(seed)
            if self.device.type == "cuda":
                torch.cuda.manual_seed(seed)
        elif record[0] == "rng_get":
            self.store[record[1]] = (
                torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()
            )
        elif record[0] == "rng_set":
            state = record[1]
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(cast(torch.Tensor, state), self.device)  # (a HostTensor unpickles as a tensor)
            else:
                torch.set_rng_state(cast(torch.Tensor, state))
        elif record[0] == "graph":  # a graph torch.compile captured on the client, by content hash
            _, key, nodes, how = record
            self.graphs.define(key, nodes, how)
        elif record[0] == "capture":  # ops captured as a graph (torch.remote_accelerator.graph): kept to replay
            _, rid, records = record
            self.store[rid] = CapturedGraph(self, records)
        elif record[0] == "replay":
            found = self.store.get(record[1])
            if not isinstance(found, CapturedGraph):
                raise RuntimeError("this captured graph is not on the server (reset, or captured in another session)")
            found.replay()
        elif record[0] == "import":  # the module that defines a custom op used here (torch.library)
            importlib.import_module(record[1])
        elif record[0] == "define":  # a custom op defined in the client's notebook, sent by value
            custom_ops.define(record)
        elif record[0] == "clock":
            self.clocks[record[1]] = device_answers.clock(self.device)
        elif record[0] == "ask":
            _, question, args = record
            return device_answers.answer(question, args, self.device, self.store.storage_bytes, self.clocks)
        elif record[0] == "load":  # a checkpoint on this machine's disk (torch.remote_accelerator.load)
            _, first_id, path = record
            leaves, spec = checkpoints.load(path, self.device)
            ids = range(first_id, first_id + len(leaves))
            for rid, leaf in zip(ids, leaves, strict=True):
                if isinstance(leaf, torch.Tensor):
                    self.store[rid] = leaf
            self._check_limits(f"the checkpoint {path}")
            return {"spec": spec, "leaves": [_described(rid, leaf) for rid, leaf in zip(ids, leaves, strict=True)]}
        elif record[0] == "read":  # a small text file on this machine's disk (a model's config.json)
            return checkpoints.read_text(record[1])
        else:
            raise ValueError(f"unknown op record {record[0]!r}")
        return None

    def adopt(self, graph: CapturedGraph) -> None:
        """A captured graph's memory is readable by every graph, and its ids' frees are told to it."""
        self.graph_memory.update(graph.memory)
        for rid in graph.made:
            self.graph_of[rid] = graph

    def _op(self, name: str) -> Any:
        """torch.ops.<name>'s kernel entry, found once per op (without OpOverload.__call__'s frame)."""
        namespace, packet, overload = name.split(".")
        try:
            found = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        except AttributeError:
            raise RuntimeError(f"the server's torch {torch.__version__} has no op {name}") from None
        shim = CPU_SHIMS.get(name) if self.device.type == "cpu" else None
        func = self._ops[name] = shim or getattr(found, "_op", found)
        return func

    def _run_op(self, record: OpRecord) -> Any:
        _, name, args, kwargs, out_ids, expect = record
        func = self._ops.get(name) or self._op(name)
        store = self.store
        inputs = []  # the arguments with the worker's tensors in (inline: this runs for every op)
        for v in args:
            if type(v) is TensorRef:
                t = store.get(ref_id(v))
                inputs.append(t if t is not None and type(t) is not _Failed else self._resolve(v))
            else:
                inputs.append(self._one(v) if type(v) in _SWAPPED else v)
        try:
            out = func(*inputs, **self._resolve_all(kwargs)) if kwargs else func(*inputs)
        except RuntimeError as exc:
            _refuse_growing_upload(exc, inputs)
        if type(out) is torch.Tensor and len(out_ids) == 1:  # the common case: one tensor out
            rid = out_ids[0]
            if rid is not None:
                want = expect[0] if expect is not None else None
                if want is not None and not _laid_out(out, want):
                    out = self._conform(name, out, want, (inputs, kwargs))
                store[rid] = out
        else:
            self._store_outputs(name, out, out_ids, expect, (inputs, kwargs))
        if len(store) > self.max_tensors or self.max_bytes is not None:
            self._check_limits(f"remote op {name}")
        return out

    def _conform(self, name: str, value: torch.Tensor, want: Expect, inputs: Any) -> torch.Tensor:
        """An output as the client expects it (_agree), noting an op whose output was not exactly so
        (copied, or accepted as equivalent): the reply names it, and the client keeps checking it."""
        if _laid_out(value, want):
            return value
        self.relaid.add(name)
        return _agree(name, value, want, inputs)

    def _store_outputs(self, name: str, out: Any, out_ids: Any, expect: Expects | None, inputs: Any) -> None:
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        # out_ids of an op run eagerly is a block of ids (a range) for a list of unknown length
        for i, (rid, value) in enumerate(zip(out_ids, outputs, strict=False)):
            if rid is None:
                continue
            want = expect[i] if expect is not None else None
            if want is not None and isinstance(value, torch.Tensor):
                value = self._conform(name, value, want, inputs)
            elif isinstance(value, torch.Tensor) and value.layout != torch.strided:
                raise NotImplementedError(
                    f"it made a {value.layout} tensor: sparse and other non-strided layouts are not "
                    "supported on remote_accelerator"
                )
            self.store[rid] = value

    def _run_call(self, record: CallRecord) -> None:
        _, name, args, kwargs, out_ids, expect = record
        args, kwargs = self._resolve_all(args), self._resolve_all(kwargs)
        if name == "graph":
            outs = self.graphs.run(kwargs["key"], args, kwargs["graph"], kwargs["needs"])
        else:
            outs = run_call(name, args, kwargs, self.store)
        for i, (rid, value) in enumerate(zip(out_ids, outs, strict=True)):
            if rid is not None:
                want = expect[i]  # (calls are checked at every use: no need to note them)
                self.store[rid] = value if want is None else _agree(name, value, want, (args, kwargs))
        self._check_limits(f"remote call {name}")


def _refuse_growing_upload(exc: RuntimeError, inputs: list[Any]) -> NoReturn:
    """An op that would grow a tensor whose memory came with the ops (`resize_`, an `out=` that
    grows, a (1,) `self` of addbmm_): a big upload stays in the segment it arrived in on a CPU
    server (no copy: protocol/tensor_ops.py), which cannot grow. Said so, where PyTorch says
    only "storage that is not resizable"."""
    uploaded = any(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.untyped_storage().resizable() for t in inputs
    )
    if not uploaded or "not resizable" not in str(exc):
        raise exc
    raise RuntimeError(
        "it would grow a tensor uploaded from the client, whose memory on a CPU server is the memory "
        "it arrived in and cannot grow; clone() it on the device first"
    ) from exc


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


def _answer(record: Record, out: Any) -> Any:
    """The batch's "eager" reply to the record it names: a question's answer, or what an op made."""
    if record[0] == "ask" or record[0] == "load" or record[0] == "read":
        return {"value": out}
    if record[0] == "op":
        return _describe(out, record[4])
    return None


def _describe(out: Any, out_ids: Sequence[int | None]) -> Any:
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
