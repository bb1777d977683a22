"""The client's ordered record of ops for one remote device, sent in one message whenever a
value is needed: one round trip per materialization, however many ops were recorded."""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from ..errors import ConnectionLost, MemoryLimitExceeded, RemoteError
from ..protocol import MessageType, contents, error_from
from ..protocol.op_records import Expects, Record
from ..serialize import deserialize_namespace
from . import forks, numerics
from .definitions import Definitions

if TYPE_CHECKING:
    from .output_specs import OutputSpec

_ids = itertools.count(1)
EMPTY_FACTORIES = frozenset({"aten.empty.memory_format", "aten.empty_strided.default"})  # (their record names)
_BLOCK = 1 << 20
_blocks = itertools.count(1 << 44, _BLOCK)  # far above any single id


def new_id() -> int:
    return next(_ids)


def new_ids() -> range:
    """A block of ids for the outputs of an op that returns a list of unknown length."""
    start = next(_blocks)
    return range(start, start + _BLOCK)


def refuse_over_limit(stream: OpStream, nbytes: int, what: str) -> None:
    """More bytes than the server lets the session hold: refused before any is sent, as an
    out-of-memory error (torch_errors.py)."""
    try:
        stream.transfers.refuse_over_limit(nbytes, what)
    except MemoryLimitExceeded as exc:
        from . import torch_errors  # (it imports torch: a session that never makes a tensor never does)

        raise torch_errors.as_torch(exc, stream.device.type) from None


class OpStream:
    """Ops recorded for one remote device. They go to the server in a batch when a value is
    needed, the one round trip that waits; with a server on another machine (or this one, when it
    has cores to spare) also every `SUBMIT_EVERY` ops without waiting, so that the server runs
    them while more are recorded here. A failure in any batch is raised at the wait, naming the op."""

    SUBMIT_EVERY = 256
    UPLOAD_PART = 32 << 20  # bytes of a big upload's part (to a worker that copies uploads out)
    SPARE_CORES = 4  # a server on this host runs alongside the notebook from this many cores up

    def __init__(self, client: Any, index: int) -> None:
        self.client = client
        self.index = index  # remote_accelerator:index, the worker of GPU `index`
        import torch

        self.device = torch.device("remote_accelerator", index)
        self._records: list[Record] = []
        # recording, and taking and sending a batch, from any thread; not `free`: the garbage collector
        # calls it inside other locks (the data plane's), which a sender holding this one waits for
        self._lock = threading.RLock()
        self._freed: collections.deque[int] = collections.deque()  # ids collected, not yet recorded
        self._inflight: list[tuple[Any, int]] = []  # batches sent without waiting: (request, ops)
        self.round_trips = 0  # batches waited for
        self.messages = 0  # batches sent
        self.ops_sent = 0
        self.server_tensors = 0  # tensors the server held after the last flush
        self.server_seconds = 0.0  # time the worker spent running what was sent
        self.wait_seconds = 0.0  # time spent here waiting for the last batch of each flush
        self.device_kind = device_type_of(client)  # what its server computes on: "cuda" or "cpu"
        self.meta_cache: dict[Any, Any] = {}  # each op signature's outputs on that device (tensor.py)
        self.default_dtype = torch.get_default_dtype()  # the one its records are made under
        self._checking: list[tuple[OutputSpec, int]] = []  # specs sent to be checked since the last flush, and when
        self.generation = 0  # cells sent to the session, custom ops' modules imported (new_generation)
        # specs verified in this generation are not checked (tensor.py dispatch); -2 while a graph is
        # captured: its ops carry every expectation (a CPU capture makes its outputs from them)
        self.trusted = 0
        client.code_watchers.add(self)
        self.transfers = client.transfers  # its bytes' data plane, and the session's byte limit
        self.versions = _versions_if_they_differ(getattr(client, "server_versions", None) or {}, torch.__version__)
        self.definitions = Definitions()  # custom ops' modules and notebook custom ops sent to the server
        self.graphs: set[str] = set()  # compiled graphs the server holds, by content hash (compiler.py)
        # On a small machine the server and this kernel share the cores: overlapping them costs more
        # than it saves (benchmarks/llm.py measures both).
        from ..config import is_loopback

        self.pipelined = (
            not is_loopback(str(getattr(client, "host", "127.0.0.1"))) or (os.cpu_count() or 1) >= self.SPARE_CORES
        )
        self._deferred: tuple[str, BaseException] | None = None
        self._borrowed = False  # a recorded upload reads a tensor's memory: send before returning
        self._uncaptured: list[Record] | None = None  # while a graph is captured: the records before it
        self.profile: dict[str, list[float]] | None = None  # set to {} to have the worker time each op (benchmarks)

    def defer(self, op: str, error: BaseException) -> None:
        """An op failed where raising is impossible (during backward): raised at the next flush."""
        if self._deferred is None:
            self._deferred = (op, error)

    @property
    def alive(self) -> bool:
        return not self.client.closed

    def record(self, entry: Record) -> None:
        with self._lock:
            if self._freed:
                self._record_frees()
            self._records.append(entry)
            full = self.pipelined and len(self._records) >= self.SUBMIT_EVERY
        if full:
            self._submit()

    def answer(self, entry: Record) -> Any:
        """Record `entry` (an op or a question whose answer the caller needs now) and send it with
        what came before it: the server's answer to it, one round trip. The batch is taken with it,
        at its end, and sent under the lock: another thread's flush cannot take its place."""
        return self._exchange(*self._send_taken([], last=entry, sync=False))["eager"]

    def follow_default_dtype(self, dtype: Any) -> None:
        """The notebook's default dtype changed (`torch.set_default_dtype`): what was recorded under
        the old one is sent (a batch runs under one: numerics.py), and no output made under it is
        taken from the meta cache."""
        self._submit()
        self.meta_cache.clear()
        self.default_dtype = dtype

    def upload(self, rid: int, tensor: Any) -> None:
        """Record a CPU tensor's values going to the server as `rid`. One that goes by the data
        plane (64 KiB and up, a data plane chosen) is refused first when it is more than the session
        may hold, and is not copied here: the batch goes out at the end of the op that records it
        (`send_uploads`), the bytes read from the tensor's own memory as they are sent. Past
        UPLOAD_PART bytes, an upload to a worker that copies it out (a GPU's) goes in parts, each
        in a batch sent at once: the worker copies one to the device while the next is copied
        here, and each takes a region of the lent segments (none as big as the tensor is made)."""
        from ..protocol.tensor_ops import HostBytes, HostTensor

        nbytes = tensor.numel() * tensor.element_size()
        refuse_over_limit(self, nbytes, "this upload to remote_accelerator")
        borrow = self.transfers.goes_by_data_plane(nbytes) and self._uncaptured is None
        if borrow and nbytes > self.UPLOAD_PART and lends_uploads(self.device_kind):
            whole = HostTensor(tensor, snapshot=False).tensor  # dense, at offset 0 (copied if it was not)
            layout = (tuple(whole.shape), whole.stride(), whole.dtype)
            parts = -(-nbytes // self.UPLOAD_PART)
            size = -(-nbytes // parts)  # parts of one size: none too small for the data plane
            try:
                for start in range(0, nbytes, size):
                    end = min(start + size, nbytes)
                    self.record(("part", rid, start, HostBytes(whole, start, end), None if start else layout))
                    self._submit()
            except BaseException:  # (interrupted, or a part refused): what parts went are let go
                self.record(("free", rid))
                raise
            return
        self.record(("put", rid, HostTensor(tensor, snapshot=not borrow)))
        self._borrowed |= borrow

    def send_uploads(self) -> None:
        """Send now what was recorded, if it reads a tensor's memory (see upload)."""
        if self._borrowed:
            self._borrowed = False
            self._submit()

    def free(self, rid: int) -> None:
        """Called when a remote tensor is garbage-collected here (any thread, inside any lock): kept
        without a lock, recorded with the next record or batch, after every op that used it. (A
        stream whose session ended keeps what it is told until it is dropped: no check on the hot
        path.)"""
        self._freed.append(rid)

    def _record_frees(self) -> None:
        """The frees collected so far, recorded (under the lock)."""
        freed = self._freed
        while freed:
            self._records.append(("free", freed.popleft()))

    def checks(self, spec: OutputSpec) -> Expects:
        """What an op with this output spec (output_specs.py) carries for the server to check, while
        the spec is not verified in this generation (dispatch tests `spec.verified == trusted`
        first). A flush whose batches all ran, none with that op's output laid out otherwise,
        verifies it: a kernel's output layout follows from its inputs' layouts, which the signature
        holds, and from the server's code (see new_generation)."""
        if self._uncaptured is None:  # (a capture's ops run when it ends, or never: not counted)
            self._checking.append((spec, self.generation))
        return spec.expect

    def new_generation(self) -> None:
        """The server's code may change from here (a cell, a custom op's module imported): every
        signature is checked again."""
        self.generation += 1
        if self._uncaptured is None:
            self.trusted = self.generation

    def code_sent(self) -> None:
        """A cell is about to go to the session (main thread): what was recorded before it goes
        first, so that it runs first (program order; while a graph is captured, what was recorded
        before the capture), and every signature is checked again after it. A failure to send
        them is raised here, before the cell goes. Frees alone wait (a cell cannot see them)."""
        with self._lock:
            self._record_frees()
            pending = self._records if self._uncaptured is None else self._uncaptured
            only_frees = all(record[0] == "free" for record in pending)
        if not only_frees:
            self._submit(before_capture=True)
        self.new_generation()

    def made_empty_last(self, rid: int) -> bool:
        """Whether the last op recorded (and not yet sent) made `rid` empty (an empty factory)."""
        with self._lock:
            last = self._records[-1] if self._records else None
        return last is not None and last[0] == "op" and last[1] in EMPTY_FACTORIES and list(last[4]) == [rid]

    def pending(self) -> int:
        return len(self._records)

    @property
    def capturing(self) -> bool:
        return self._uncaptured is not None

    def begin_capture(self) -> None:
        """Record into a graph's list (captured.py) until end_capture; nothing is sent meanwhile."""
        if self._uncaptured is not None:
            raise RuntimeError("a graph is already being captured on this device")
        with self._lock:
            self._record_frees()  # (frees collected before it go before it)
            self._uncaptured, self._records = self._records, []
        self.trusted = -2

    def end_capture(self) -> list[Record]:
        """The records since begin_capture; recording goes on where it was."""
        if self._uncaptured is None:
            raise RuntimeError("no graph is being captured on this device")
        with self._lock:
            captured, self._records, self._uncaptured = self._records, self._uncaptured, None
        self.trusted = self.generation
        return captured

    def idle(self) -> bool:
        """Nothing recorded and no batch in flight: all work so far has run (a batch sent without
        waiting counts as running until the next flush reads its reply)."""
        return not self._records and not self._inflight

    def _send(self, request: contents.OpBatch, n: int) -> Any:
        forks.refuse_in_a_forked_child()
        request["numerics"] = numerics.current(self.default_dtype)
        if self.profile is not None:
            request["profile"] = True
        if not self.alive:
            raise ConnectionLost(
                "this remote tensor belongs to a Genie session that has ended; run %genie_init and make it again"
            )
        oob: list[Any] = []
        payload = pickle.dumps(request, protocol=5, buffer_callback=oob.append)
        self.messages += 1
        self.ops_sent += n
        channel = self.transfers.channel
        content = contents.TensorOps(gpu=self.index, n=n, staged=channel.staged, streamed=channel.streams)
        raws = [b.raw() for b in oob]
        lent_to = self.index if lends_uploads(self.device_kind) else None  # (big bytes go by the data plane)
        return self.transfers.request(MessageType.TENSOR_OPS, content, [payload], raws, lent_to=lent_to)

    def _submit(self, *, before_capture: bool = False) -> None:
        """Send what was recorded; the reply is read at the next flush. While a graph is captured,
        its records go at the end of the capture; `before_capture`: what was recorded before it goes.
        Taken and sent under the lock: batches reach the server in the order they were taken."""
        with self._lock:
            if self._uncaptured is None:
                self._record_frees()
                records, self._records = self._records, []
                self._borrowed = False
            elif before_capture:
                records, self._uncaptured = self._uncaptured, []
            else:
                return
            if records:
                try:
                    sent = self._send({"ops": records, "fetch": [], "answer": -1, "sync": False}, len(records))
                except BaseException:
                    self._checking = []  # what they carried to check never ran
                    self.definitions.forget(self.definitions.taken())
                    raise
                self._inflight.append((sent, len(records)))

    def flush(self, fetch: list[int] | None = None, *, sync: bool = False) -> contents.TensorReply:
        """Send what was recorded (and fetch these ids), wait; raise the first failure: one kept
        from backward (see defer), else the first the server reports."""
        return self._exchange(*self._send_taken(list(fetch or []), last=None, sync=sync))

    def _send_taken(self, fetch: list[int], *, last: Record | None, sync: bool) -> tuple[Any, ...]:
        """Take the batch to send now and wait for (refused during a capture, as CUDA refuses a
        sync), with `last` recorded at its end, and send it, all under the lock: whichever threads
        record and flush, batches reach the server in the order they were taken (a batch sent
        ahead of an earlier one would use tensors not made yet). Returns what `_exchange` waits on."""
        self._refuse_while_capturing()
        with self._lock:
            self._record_frees()
            if last is not None:
                self._records.append(last)
            records, self._records = self._records, []
            self._borrowed = False
            answer = len(records) - 1 if last is not None else -1
            checking, self._checking = self._checking, []
            sent_names = self.definitions.taken()
            try:
                request = self._send({"ops": records, "fetch": fetch, "answer": answer, "sync": sync}, len(records))
            except BaseException:
                self.definitions.forget(sent_names)
                raise
            earlier, self._inflight = self._inflight, []
        return records, request, earlier, checking, sent_names

    def _refuse_while_capturing(self) -> None:
        if self._uncaptured is not None:
            raise RuntimeError(
                "this needs a value from the server, which is not permitted while a graph is being captured "
                f"on {self.device} (as on CUDA): capture only device work, read values after the capture"
            )

    def _exchange(self, *taken: Any) -> contents.TensorReply:
        """Wait for the batches `_send_taken` took (see _replies); on a failure, the definitions
        they sent are forgotten (definitions.py)."""
        *batch, sent_names = taken
        try:
            return self._replies(*batch)
        except BaseException:
            self.definitions.forget(sent_names)
            raise

    def _replies(
        self, records: list[Record], request: Any, earlier: list[tuple[Any, int]], checking: list[Any]
    ) -> contents.TensorReply:
        """Wait for every batch sent before `records` and then for theirs (see flush)."""
        failure: tuple[contents.TensorReply, int] | None = None
        relaid: set[str] = set()
        for sent, n in earlier:  # answered before the last one: the worker runs batches in order
            content = self._wait(sent).content
            _account(self, content)
            relaid.update(content.get("relaid") or ())
            if failure is None and content.get("status") != "ok":
                failure = (content, n)
        waited = time.perf_counter()
        reply = self._wait(request)
        self.wait_seconds += time.perf_counter() - waited
        self.round_trips += 1
        content = reply.content
        self.server_tensors = int(content.get("stored", 0))
        _account(self, content)
        if failure is None and content.get("status") != "ok":
            failure = (content, len(records))
        if failure is None and self._deferred is None:
            relaid.update(content.get("relaid") or ())
            for spec, generation in checking:
                spec.verified = generation if spec.op not in relaid else -1
        if self._deferred is not None:  # the batch's own failures follow from it
            (op, error), self._deferred = self._deferred, None
            raise RuntimeError(f"{op} failed during backward: {type(error).__name__}: {error}") from error
        if failure is not None:
            bad, n = failure
            where = f"op {bad.get('index', 0) + 1} of {n} sent together"
            failed = error_from(bad, f"remote op {bad.get('op')} ({where}) failed{self.versions}: ")
            from . import torch_errors

            raise torch_errors.as_torch(failed, self.device.type)
        if content.get("fetch"):
            ref = content.get("data")  # staged by the worker: fetched over the data plane
            buffers = self.transfers.receive(ref, "fetch of remote tensors") if ref else reply.buffers
            content["values"] = deserialize_namespace(content["fetch"], buffers, allow_pickle=False)  # tensors, numbers
        return content

    def _wait(self, request: Any) -> Any:
        """A batch's reply. One that failed, or whose connection did, frees the bytes it sent over
        the data plane if the worker never took them (a segment nobody would remove)."""
        try:
            reply = request.wait()
        except RemoteError as exc:  # (a fetch of a tensor whose op failed: of that failure's kind)
            self.transfers.failed(request)
            from . import torch_errors

            raise torch_errors.as_torch(exc, self.device.type) from None
        except BaseException:
            self.transfers.failed(request)
            raise
        if cast(contents.TensorReply, reply.content).get("status") != "ok":
            self.transfers.failed(request)
        return reply

    def fetch(self, rid: int) -> Any:
        return self.flush([rid])["values"][str(rid)]


def _account(stream: OpStream, content: contents.TensorReply) -> None:
    """The server's time on a batch, and each op's where the stream profiles (benchmarks)."""
    stream.server_seconds += float(content.get("run_s", 0.0))
    if stream.profile is not None:
        for name, (seconds, calls) in (content.get("profile") or {}).items():
            entry = stream.profile.setdefault(name, [0.0, 0])
            entry[0] += seconds
            entry[1] += calls


def _versions_if_they_differ(server: dict[str, Any], mine: str) -> str:
    """What a failed op's error adds where client and server run different torch releases: ops
    are recorded by this client's torch and run by the server's, and may differ between them."""
    from ..torch_compat import release

    theirs = server.get("torch")
    if not theirs or release(theirs) == release(mine):
        return ""
    return f" (this client runs torch {mine}, the server torch {theirs})"


UPLOAD_SEGMENTS = ("lent", "adopted")


def lends_uploads(device_kind: str) -> bool:
    """Whether a batch's uploads go in lent segments (dataplane/lent.py), filled again once the
    worker has copied them out, or in one-off segments the worker adopts as the tensors' memory:
    lent where the server computes on a GPU (the worker copies every upload to it), adopted on a
    CPU server (no copy). GENIE_UPLOAD_SEGMENTS=lent or adopted chooses (benchmarks, tests); a
    name that is neither is an error, never a silent default."""
    chosen = os.environ.get("GENIE_UPLOAD_SEGMENTS")
    if chosen is None:
        return device_kind == "cuda"
    if chosen not in UPLOAD_SEGMENTS:
        raise ValueError(f"GENIE_UPLOAD_SEGMENTS={chosen!r}: expected one of {', '.join(UPLOAD_SEGMENTS)}")
    return chosen == "lent"


def device_type_of(client: Any) -> str:
    """What `remote_accelerator` computes on at `client`'s server: "cuda" where it has GPUs, else
    "cpu" (simulated GPUs, `--simulate-gpus`, are readings only: their worker computes on the CPU)."""
    node = getattr(client, "node", None) or {}
    return "cuda" if node.get("gpus") and not node.get("simulated_gpus") else "cpu"
