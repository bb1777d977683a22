"""What each message contains: one TypedDict (PEP 589) per message type's content, used by the
side that builds it and the side that reads it, so that mypy sees both ends of the wire (as
jupyter_client's messaging spec gives every message's fields). `CONTENT` maps each type to its
shape. Received content is JSON that only the signature vouches for: readers still use `.get`
with defaults and convert what they use; the shapes say what a well-behaved peer sends."""

from __future__ import annotations

import sys
from typing import Any, TypedDict

from .messages import MessageType
from .op_records import Record

if sys.version_info >= (3, 11):  # noqa: UP036 - requires-python is >=3.10
    from typing import NotRequired
else:
    from typing_extensions import NotRequired  # noqa: UP035


# -- parts that several contents share ----------------------------------------------------------
class DataRef(TypedDict):
    """Bytes that went over the data plane instead of inline: a shared-memory segment."""

    segment: str
    sizes: list[int]  # of the buffers packed in it, in order
    lent: NotRequired[bool]  # the worker copies the bytes out; the client fills the segment again (dataplane/lent.py)
    retired: NotRequired[list[str]]  # lent segments the client let go since its last lent one: unmap them
    lender: NotRequired[str]  # the client's pool of lent segments (a client that reattached has a new one)
    offset: NotRequired[int]  # where in a lent segment the buffers start (its region: dataplane/lent.py)
    filling: NotRequired[bool]  # the worker fills it after its reply; the data port sends it as it fills
    reused: NotRequired[bool]  # (with filling) the worker takes it back once sent, to fill again


class SyncState(TypedDict):
    """The session directory a worker runs in (`%genie_sync`): re-import what changed when
    `generation` moves."""

    dir: str
    generation: int


class ToWorker(TypedDict, total=False):
    """What any request the server hands to a session's worker may carry."""

    gpu: int | None  # the slot it is for; absent or None: the session's own
    data: DataRef  # its buffers, when they went over the data plane (client.transfers.send)
    sync: SyncState  # added by the server: the session directory the worker runs in


class Failure(TypedDict, total=False):
    """An error, on its own (an error reply, an `error` output) or in a reply whose status is
    "error"; `protocol/errors.py` turns it into an exception."""

    ename: str
    evalue: str
    traceback: list[str]


class Reply(Failure):
    """A reply that says whether its request worked (with the error when it did not)."""

    status: str  # "ok" or "error"


class Staged(Reply):
    """A reply whose bytes may wait on the server for the data plane instead of coming inline."""

    data: NotRequired[DataRef]


class Output(TypedDict, total=False):
    """What every output of a running cell may carry."""

    n: int  # a background job's outputs, numbered by the server


class GPUDescription(TypedDict):
    """A GPU as a server describes it in its welcome: the fields of `nodes.GPUInfo` that do not
    change (`GPUInfo.description()` makes one). A GPU asked for by index but not found is only
    its index and the name "unknown"."""

    index: int
    name: NotRequired[str]
    uuid: NotRequired[str]
    memory_total: NotRequired[int]  # bytes


class Limits(TypedDict):
    """What a server lets one session hold and send (None: no limit)."""

    session_tensors: int
    session_bytes: int | None
    message_bytes: int


class NodeDescription(TypedDict, total=False):
    """A server as its welcome and `info` describe it (empty until a client has its welcome)."""

    node_id: str
    hostname: str
    address: str
    pid: int
    version: str
    protocol: int
    python: str
    platform: str
    gpus: list[GPUDescription]
    gpu_reason: str  # why there are none
    simulated_gpus: int  # fake readings (--simulate-gpus), labelled so
    transport: dict[str, Any]  # what each data-plane backend offers (dataplane.Backend.offer)
    encrypted: bool
    limits: Limits
    started: float


class ClientDescription(TypedDict):
    """Who a hello comes from (the server keeps each value as a string, cut at 200 characters)."""

    host: str
    pid: int
    user: str
    purpose: str  # "probe" for `genie status`, which the session list leaves out


class JobState(TypedDict):
    """A background job as the server keeps it (`server/jobs.py`). A client's record of a job it
    has just started has only its id, name and summary."""

    id: str
    name: str
    summary: NotRequired[str]
    started: NotRequired[float]
    ended: NotRequired[float | None]
    state: NotRequired[str]  # running, ok, error or stopped
    error: NotRequired[str]
    outputs: NotRequired[int]  # how many it has had
    dropped: NotRequired[int]  # the oldest ones let go
    tail: NotRequired[str]
    messages: NotRequired[list[list[Any]]]  # [n, type, content] of the outputs asked for


class RequestOutcome(TypedDict):
    """What became of a request ("did it run?"): running, finished (with its status), stopped or
    not received."""

    state: str
    type: NotRequired[str]
    received: NotRequired[float]
    status: NotRequired[str]
    finished: NotRequired[float]
    error: NotRequired[str]


class WorkerInfo(TypedDict):
    id: str  # a hash of it: the id itself opens the worker's socket
    pid: int
    slot: int
    ready: bool
    busy: bool


class SessionInfo(TypedDict):
    """A session as `info` lists it."""

    id: str  # its first 8 characters
    name: str
    jobs_running: int
    detached: bool
    client: dict[str, str]  # ClientDescription, as the server keeps it
    slot: int
    backend: str
    created: float
    idle_s: float
    workers: NotRequired[list[WorkerInfo]]


class Monitoring(TypedDict):
    enabled: bool
    interval: float
    source: str


class TelemetryReport(TypedDict):
    """What a server's readings say, for `info`."""

    metrics: dict[str, Any] | None  # nodes.NodeInfo.to_dict(), each GPU process labelled with its session
    health: dict[str, Any] | None  # monitoring.health.HealthReport.to_dict()
    history: dict[str, list[tuple[float, float]]]
    events: list[Event]
    monitoring: Monitoring


# -- client -> server ---------------------------------------------------------------------------
class Empty(TypedDict):
    """The content of `ping` and `close`."""


class Hello(TypedDict):
    client: ClientDescription
    heartbeat: str  # the routing id (hex) of the connection that pings and hears events
    versions: dict[str, str | None]  # versions.local_versions()
    name: str  # a named session outlives its client ("": it ends with it)


class Execute(ToWorker):
    code: str
    silent: bool
    job: NotRequired[str]  # run in the background under this name ("": the server names it)


class Push(ToWorker):
    values: list[dict[str, Any]]  # serialize.serialize_namespace's descriptions
    device: str | None


class Pull(ToWorker):
    names: list[str]
    staged: NotRequired[bool]  # stage the bytes for the data plane (added by client.transfers.fetch)
    streamed: NotRequired[bool]  # ... and reply before filling them: the server's data port fetches them


class TensorOps(ToWorker):
    """Its first buffer is the pickled `OpBatch`, the others that pickle's out-of-band buffers
    (or, when they went over the data plane, `data` says where they are)."""

    n: int  # ops in the batch
    staged: NotRequired[bool]  # the client fetches big values over its data plane: stage them
    streamed: NotRequired[bool]  # ... through the server's data port: reply before filling them


# deterministic algorithms (and warn only), float32 matmul precision, cuDNN deterministic and benchmark,
# the default dtype's name ("float32")
Numerics = tuple[bool, bool, str, bool, bool, str]


class OpBatch(TypedDict):
    """What a `tensor_ops` request carries, pickled (protocol 5) in its first buffer."""

    ops: list[Record]  # op records, in order (protocol/op_records.py)
    fetch: list[int]  # ids of the remote tensors whose values come back
    answer: int  # index in `ops` of the op to describe (what it made) or the question to answer; -1: none
    sync: bool  # wait for the device before answering
    profile: NotRequired[bool]  # time each op (benchmarks)
    numerics: NotRequired[Numerics]  # the notebook's settings the batch runs under (remote_tensor/numerics.py)


class Interrupt(TypedDict):
    request: str | None  # None: whichever cell runs, or else the next to run


class Outcome(TypedDict):
    ids: list[str]


class Info(TypedDict):
    history_points: int
    events: int


class DataProbe(TypedDict):
    data: DataRef | None  # None: the bytes are inline


class SetBackend(TypedDict):
    backend: str


class Jobs(TypedDict):
    since: dict[str, int]  # request id -> the first output wanted


class Sync(TypedDict):
    """Its buffers are the contents of `files`, in order."""

    manifest: dict[str, str]  # relative path -> SHA-256: what the session directory should hold
    files: list[str]


# `for` is a keyword: the functional form
FileStat = TypedDict(
    "FileStat",
    {
        "sync": NotRequired[SyncState],  # as in ToWorker, which a functional TypedDict cannot extend
        "path": str,
        "for": NotRequired[str],  # "upload": the part file so far, else the file
        "prefix": NotRequired[int],  # bytes the client holds, whose hash it wants
    },
)


class FilePut(ToWorker):
    path: str
    offset: int
    sha256: NotRequired[str]  # the whole file's, on the last piece


class FileGet(ToWorker):
    path: str
    offset: int
    length: int
    staged: NotRequired[bool]  # added by client.transfers.fetch
    streamed: NotRequired[bool]  # (added too; a file's bytes are staged whole before the reply)


# -- server (or worker) -> client: replies ----------------------------------------------------
class Welcome(TypedDict):
    session: str
    node: NodeDescription
    slot: int
    versions: dict[str, str | None]
    name: str
    attached: bool  # to a named session that was already running
    created: float
    jobs: list[JobState]  # the running ones
    job_names: list[str]  # also those that ended


class AuthFailed(TypedDict):
    reason: str


class Pong(TypedDict):
    time: float


class ExecuteReply(Reply):
    execution_count: NotRequired[int]
    ran: NotRequired[bool]  # False: interrupted before it started
    outputs: NotRequired[int]  # a job's: how many outputs it had (the server adds it)


class PushReply(Reply):
    names: NotRequired[list[str]]


class PullReply(Staged):
    """Its buffers are the values' bytes, unless they are staged for the data plane (`data`)."""

    values: NotRequired[list[dict[str, Any]]]


class TensorReply(Staged):
    """Its buffers are the bytes of the tensors fetched (or `data` says where they wait)."""

    stored: int  # tensors the worker holds for the session
    eager: NotRequired[Any]  # what the record OpBatch.answer names made (its description), or its answer
    run_s: NotRequired[float]
    profile: NotRequired[dict[str, list[float]]]  # op -> [seconds, calls], when asked
    fetch: NotRequired[list[dict[str, Any]]]  # serialize_namespace's descriptions of what was fetched
    op: NotRequired[str]  # on failure: the op that failed, and its place in the batch
    index: NotRequired[int]
    # ops with an output the worker did not find exactly as the client promised (copied into that
    # layout, or taken as equivalent): their signatures stay checked at each use (OpStream.checks)
    relaid: NotRequired[list[str]]
    kept: NotRequired[bool]  # the batch's lent segment is still viewed by the worker: the client lets it go
    values: NotRequired[dict[str, Any]]  # not sent: the fetched values, as remote_tensor.stream adds them


class InterruptReply(TypedDict):
    cancelled: int  # cells still waiting for their worker: they never run
    forwarded: int  # workers told


class OutcomeReply(TypedDict):
    outcomes: dict[str, RequestOutcome]


class InfoReply(TelemetryReport):
    node: NodeDescription
    sessions: list[SessionInfo]


class DataProbeReply(TypedDict):
    bytes: int


class SetBackendReply(TypedDict):
    ok: bool


class CloseReply(TypedDict):
    status: str


class JobsReply(TypedDict):
    jobs: list[JobState]


class SyncReply(TypedDict):
    missing: list[str]
    written: int
    removed: int
    unchanged: int
    generation: int
    dir: str


class FileReply(Staged):
    part_size: NotRequired[int]  # stat for an upload: the part file so far
    part_sha256: NotRequired[str]
    size: NotRequired[int]
    sha256: NotRequired[str]
    prefix_sha256: NotRequired[str]
    path: NotRequired[str]  # an upload's last piece: where the file is


# -- outputs of a running cell (worker -> server -> client) -----------------------------------
class Stream(Output):
    name: str  # stdout or stderr
    text: str


class DisplayData(Output):
    """Also the content of `update_display_data`."""

    data: dict[str, Any]  # mime type -> value
    metadata: dict[str, Any]
    transient: NotRequired[dict[str, Any]]


class ExecuteResult(DisplayData):
    execution_count: int


class ClearOutput(Output):
    wait: bool


class Error(Failure, Output):
    """An exception the cell's code raised (its traceback as IPython formats it)."""


# -- sent on the server's own initiative, and by a worker to its server ------------------------
class Event(TypedDict):
    """events.ClusterEvent.to_dict()."""

    type: str
    node: str
    severity: str
    data: dict[str, Any]
    time: float


class Metrics(TypedDict):
    node: dict[str, Any]  # nodes.NodeInfo.to_dict()
    health: dict[str, Any] | None


class Ready(TypedDict):
    pid: int
    python: str
    cuda_visible_devices: str | None


class Staging(TypedDict):
    """How far a worker has filled the segment its last reply named (`filling`), or why it stopped."""

    filled: int
    ename: NotRequired[str]
    evalue: NotRequired[str]


NOT_STARTED = "interrupted before it started: the cell did not run"


def interrupted_before_start() -> tuple[Error, ExecuteReply]:
    """What a cell interrupted before it started answers, whoever stops it (the server, while its
    worker starts; the worker, while it runs an earlier request): its error and its reply."""
    error = Error(ename="KeyboardInterrupt", evalue=NOT_STARTED, traceback=[f"KeyboardInterrupt: {NOT_STARTED}"])
    return error, ExecuteReply(status="error", ename="KeyboardInterrupt", evalue=NOT_STARTED, ran=False)


T = MessageType
CONTENT: dict[MessageType, object] = {
    T.HELLO: Hello,
    T.PING: Empty,
    T.EXECUTE: Execute,
    T.PUSH: Push,
    T.PULL: Pull,
    T.TENSOR_OPS: TensorOps,
    T.INTERRUPT: Interrupt,
    T.OUTCOME: Outcome,
    T.INFO: Info,
    T.DATA_PROBE: DataProbe,
    T.SET_BACKEND: SetBackend,
    T.CLOSE: Empty,
    T.JOBS: Jobs,
    T.SYNC: Sync,
    T.FILE_STAT: FileStat,
    T.FILE_PUT: FilePut,
    T.FILE_GET: FileGet,
    T.WELCOME: Welcome,
    T.AUTH_FAILED: AuthFailed,
    T.PONG: Pong,
    T.EXECUTE_REPLY: ExecuteReply,
    T.PUSH_REPLY: PushReply,
    T.PULL_REPLY: PullReply,
    T.TENSOR_REPLY: TensorReply,
    T.INTERRUPT_REPLY: InterruptReply,
    T.OUTCOME_REPLY: OutcomeReply,
    T.INFO_REPLY: InfoReply,
    T.DATA_PROBE_REPLY: DataProbeReply,
    T.SET_BACKEND_REPLY: SetBackendReply,
    T.CLOSE_REPLY: CloseReply,
    T.JOBS_REPLY: JobsReply,
    T.SYNC_REPLY: SyncReply,
    T.FILE_REPLY: FileReply,
    T.ERROR_REPLY: Failure,
    T.STREAM: Stream,
    T.DISPLAY_DATA: DisplayData,
    T.UPDATE_DISPLAY_DATA: DisplayData,
    T.CLEAR_OUTPUT: ClearOutput,
    T.EXECUTE_RESULT: ExecuteResult,
    T.ERROR: Error,
    T.EVENT: Event,
    T.METRICS: Metrics,
    T.READY: Ready,
    T.STAGING: Staging,
}
