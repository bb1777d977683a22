"""The client side of a session with one genie server: `Client` is what `%genie_init` and
`genie_core.init` make. Its parts: the connection (sockets, handshake, heartbeats), recovery
("did it run?" after a lost connection) and transfers (pushes and pulls over the data plane)."""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, cast

from ..dataplane import BackendReport, Channel
from ..errors import VersionMismatch
from ..events import ClusterEvent, EventBus, EventType, Severity
from ..monitoring.health import Grade, HealthCheck, HealthReport, worst
from ..nodes import NodeInfo
from ..protocol import Message, MessageType, contents
from ..versions import compare, local_versions
from .code_sync import CodeSync, SyncReport
from .connection import Connection, Request
from .files import FileResult, FileTransfers
from .jobs import Job
from .options import ConnectOptions
from .recovery import LostRequest, Recovery
from .transfers import Transfers

__all__ = ["Client", "ConnectOptions", "Job", "LostRequest", "Request"]

T = MessageType


class CodeWatcher(Protocol):
    def code_sent(self) -> None: ...


class Client:
    """One session on one genie server. `Client(host, port, token, timeout=10).connect()`: the
    keywords are `ConnectOptions` fields (or pass `options=`, and keywords to change some)."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        options: ConnectOptions | None = None,
        events: EventBus | None = None,
        **changes: Any,
    ) -> None:
        self.options = replace(options or ConnectOptions(), **changes)  # a misspelt option: TypeError naming it
        self.connection = Connection(host, port, token, self.options)
        self.events = events or EventBus()
        self.metrics: NodeInfo | None = None  # the newest snapshot the server pushed
        self.server_health: HealthReport | None = None
        self.recovery = Recovery(self.connection, self._event)
        self.transfers = Transfers(self.connection, self.options.data_port)
        self.files = FileTransfers(self.connection, self.transfers)
        self.connection.on_unsolicited = self._on_unsolicited
        self.server_versions: dict[str, str | None] = {}  # Genie, protocol, Python, torch, CUDA there
        self.version_warnings: list[str] = []  # differences that do not stop the connection
        self.attached = False  # this client attached to a named session that was already running
        self.session_created: float | None = None
        self._jobs: dict[str, Job] = {}
        self._job_names: set[str] = set()
        self.code_sync: CodeSync | None = None  # the directory %genie_sync keeps in step
        self._job_count = 0
        # told before each cell or sync is sent (remote-tensor op streams: remote_tensor/stream.py code_sent)
        self.code_watchers: weakref.WeakSet[CodeWatcher] = weakref.WeakSet()

    # -- what it is connected to ------------------------------------------------------------
    @property
    def address(self) -> str:
        return self.connection.address

    @property
    def host(self) -> str:
        return self.connection.host

    @property
    def session(self) -> str:
        return self.connection.session

    @property
    def session_name(self) -> str:
        """The name of a named session ("" for one that ends with this client)."""
        return self.options.session_name

    @property
    def node(self) -> contents.NodeDescription:
        return self.connection.node

    @property
    def slot(self) -> int | None:
        return self.connection.slot

    @property
    def rtt(self) -> float | None:
        return self.connection.rtt

    @property
    def lost_reason(self) -> str | None:
        return self.connection.lost_reason

    @property
    def connected(self) -> bool:
        return self.connection.connected

    @property
    def closed(self) -> bool:
        return self.connection.closed

    @property
    def channel(self) -> Channel:
        """The data-plane channel in use (`channel.name`: the backend discovery chose)."""
        return self.transfers.channel

    @property
    def backend_report(self) -> BackendReport | None:
        return self.transfers.report

    @property
    def lost_requests(self) -> dict[str, LostRequest]:
        return self.recovery.lost

    def take_settled(self) -> list[LostRequest]:
        """Lost requests whose fate is now known and not yet reported (each is returned once)."""
        return self.recovery.take_settled()

    # -- the API --------------------------------------------------------------------------
    def connect(self) -> Client:
        """Handshake, then compare versions: a difference that breaks the protocol or pickling
        ends the session at once with VersionMismatch; smaller ones land in `version_warnings`."""
        welcome = self.connection.connect()
        self.attached = bool(welcome.get("attached"))
        self.session_created = welcome.get("created")
        for record in welcome.get("jobs") or []:  # jobs an earlier client of this named session started
            self._follow_job(record, None)
        self._job_names = set(welcome.get("job_names") or [])  # also ended ones: a new job-N must not replace one
        self.server_versions = welcome.get("versions") or {}
        if not self.server_versions:
            self.version_warnings = [f"the server at {self.address} did not say its versions (an older Genie)"]
        else:
            verdict = compare(local_versions(), self.server_versions, self.address)
            if verdict.errors:  # a server too old to check: leave a session we attached to running
                self.close(notify=not self.attached)
                raise VersionMismatch("; ".join(verdict.errors))
            self.version_warnings = verdict.warnings
        self._event(
            EventType.CONNECTED,
            Severity.INFO,
            f"connected to {self.address} (session {self.session[:8]})",
            session=self.session[:8],
        )
        return self

    def select_backend(self, requested: str = "auto", budget: float = 1.0) -> BackendReport:
        """Measure the data-plane backends to this server and use the best (or the one asked for)."""
        report = self.transfers.select(requested, budget)
        self._event(
            EventType.BACKEND_SELECTED, Severity.INFO, report.reason, backend=report.chosen, report=report.to_dict()
        )
        return report

    def request(self, msg: Message) -> Request:
        """Send a request on the control connection; its replies arrive on the returned Request."""
        return self.connection.request(msg)

    def _code_sent(self) -> None:
        for watcher in list(self.code_watchers):
            watcher.code_sent()

    def execute(self, code: str, *, gpu: int | None = None, silent: bool = False) -> Request:
        self._code_sent()
        request = self.request(Message(T.EXECUTE, contents.Execute(code=code, gpu=gpu, silent=silent)))
        first = next((line.strip() for line in code.splitlines() if line.strip()), "")
        request.summary = first if len(first) <= 60 else first[:57] + "..."
        return request

    def start_job(self, code: str, *, name: str | None = None, gpu: int | None = None) -> Job:
        """Run a cell in the background: returns at once. Later requests to the session's worker
        (cells, pushes, pulls, remote-tensor work) queue behind it; its output is kept on the server."""
        if name is None:
            self._job_count += 1
            name = f"job-{self._job_count}"
            while name in self._job_names or any(j.name == name for j in self._jobs.values()):
                self._job_count += 1
                name = f"job-{self._job_count}"
        clash = next((j for j in self._jobs.values() if j.name == name and not j.done()), None)
        if clash is not None:
            raise ValueError(f"a job named {name!r} is still running ({clash.elapsed:.0f} s): pick another name")
        self._code_sent()
        request = self.connection.request(
            Message(T.EXECUTE, contents.Execute(code=code, gpu=gpu, silent=False, job=name)), background=True
        )
        return self._follow_job(contents.JobState(id=request.id, name=name, summary=code.strip()[:60]), request)

    def _follow_job(self, record: contents.JobState, request: Request | None) -> Job:
        def gone() -> str:
            if self.connection.session_gone:
                return f"the session ended ({self.lost_reason or 'the server no longer has it'})"
            return "this client closed its connection" if self.closed else ""

        job = Job(self._ask_jobs, self.interrupt, gone, record, request)
        self._jobs[job.id] = job
        return job

    def jobs(self, timeout: float = 10.0) -> list[Job]:
        """The session's jobs as the server has them (also those an earlier client started), oldest first."""
        for record in self._ask_jobs({}, timeout):
            job = self._jobs.get(str(record["id"]))
            if job is None:
                self._follow_job(record, None)
            else:
                job.update(record)
        return sorted(self._jobs.values(), key=lambda j: j.started)

    def sync(self, path: str | Path = ".", *, max_file: int | None = None, max_total: int | None = None) -> SyncReport:
        """Copy the directory's Python files and small data files (less what .gitignore ignores)
        into the session's directory on the server, which its workers run in and import from;
        modules whose files changed are re-imported there before the next request.
        Later, `sync_if_changed()` repeats it at the cost of a local scan when nothing changed."""
        limits = {k: v for k, v in (("max_file", max_file), ("max_total", max_total)) if v is not None}
        root = Path(path).expanduser().resolve()
        if self.code_sync is None or self.code_sync.root != root or limits:
            self.code_sync = CodeSync(root, **limits)
        return self.code_sync.run(self._send_sync)

    def sync_if_changed(self) -> SyncReport | None:
        """Sync again if a file under the synced directory changed (None: nothing to do)."""
        return None if self.code_sync is None else self.code_sync.run_if_changed(self._send_sync)

    def _send_sync(self, manifest: dict[str, str], names: list[str], data: list[bytes]) -> contents.SyncReply:
        self._code_sent()  # (the server's modules may change from here, as with a cell)
        msg = Message(T.SYNC, contents.Sync(manifest=manifest, files=names), list(data))
        reply = self.request(msg).wait(self.options.timeout + sum(map(len, data)) / (10 << 20))
        return cast(contents.SyncReply, reply.content)

    def running_jobs(self) -> list[Job]:
        """The jobs this client knows to be running (no round trip)."""
        return [j for j in self._jobs.values() if not j.done()]

    def _ask_jobs(self, since: dict[str, int], timeout: float = 10.0) -> list[contents.JobState]:
        reply = self.request(Message(T.JOBS, contents.Jobs(since=since))).wait(timeout)
        return list(cast(contents.JobsReply, reply.content).get("jobs") or [])

    def interrupt(self, request: Request | str | None = None) -> None:
        """Interrupt a cell (default: whichever runs, or if none does yet, the next to run; the cells
        behind it still run): KeyboardInterrupt in its code, or, if it has not started yet, it never
        runs. Its own reply says which; a finished cell is left alone."""
        target = request.id if isinstance(request, Request) else request
        self.request(Message(T.INTERRUPT, contents.Interrupt(request=target)))

    def push(
        self,
        values: dict[str, Any],
        *,
        gpu: int | None = None,
        device: str | None = None,
        timeout: float | None = None,
        progress: Any = None,
    ) -> list[str]:
        """Send values to the session's worker. `progress(done, total)` follows the bytes (data plane only)."""
        return self.transfers.push(values, gpu=gpu, device=device, timeout=timeout, progress=progress)

    def pull(
        self, names: list[str], *, gpu: int | None = None, timeout: float | None = None, progress: Any = None
    ) -> dict[str, Any]:
        """Bring values back from the session's worker. `progress(done, total)` as with `push`."""
        return self.transfers.pull(names, gpu=gpu, timeout=timeout, progress=progress)

    def upload(self, local: str | Path, remote: str | None = None, *, progress: Any = None) -> FileResult:
        """Copy a file to the server (a relative `remote` is in the session's directory), over the data
        plane, SHA-256-checked; after a lost connection it continues where it stopped."""
        return self.files.upload(local, remote, progress)

    def download(self, remote: str, local: str | Path | None = None, *, progress: Any = None) -> FileResult:
        """Copy a file from the server here, as `upload` does the other way."""
        return self.files.download(remote, local, progress)

    def ping(self, timeout: float = 5.0) -> float:
        import time

        start = time.perf_counter()
        self.request(Message(T.PING)).wait(timeout)
        return time.perf_counter() - start

    def info(self, timeout: float = 5.0, history_points: int = 60, events: int = 50) -> contents.InfoReply:
        """The server's node, latest readings, health, recent history and events, sessions."""
        asked = Message(T.INFO, contents.Info(history_points=history_points, events=events))
        return cast(contents.InfoReply, self.request(asked).wait(timeout).content)

    def close(self, notify: bool = True) -> None:
        """End the session (`notify`: tell the server now) or, with notify=False, leave it to the
        server: a session without a name ends after its lease, a named one waits for a client."""
        if self.connection.closed:
            return
        if notify and self.connected:
            self.connection.closing = True
            try:
                self.request(Message(T.CLOSE)).wait(timeout=1.0)
            except Exception:
                pass  # the server reaps the session after its lease anyway
            except BaseException:  # interrupted while waiting: still open, so a loss is told again
                self.connection.closing = False
                raise
        for job in self._jobs.values():
            job.stop_following("this client closed its session" if notify else "this client detached")
        self.connection.session_closed()
        if self.session:
            left = not notify and self.session_name
            self._event(
                EventType.SESSION_DETACHED if left else EventType.SESSION_CLOSED,
                Severity.INFO,
                f"detached from session {self.session_name!r}: it keeps running on the server"
                if left
                else f"session {self.session[:8]} closed",
                session=self.session[:8],
            )
        self.transfers.close()
        self.connection.close()

    # -- what the server tells us ---------------------------------------------------------
    def _on_unsolicited(self, msg: Message) -> None:
        """Messages the server sends on its own: events and metric snapshots."""
        if msg.type == T.EVENT:
            self.events.emit(ClusterEvent.from_dict(cast(contents.Event, msg.content)))
        elif msg.type == T.METRICS:
            metrics = cast(contents.Metrics, msg.content)
            self.metrics = NodeInfo.from_dict(metrics["node"])
            health = metrics.get("health")
            if health:
                self.server_health = HealthReport.from_dict(health)
            data = cast(dict[str, Any], msg.content)  # the readings themselves, as they came
            self.events.emit(ClusterEvent(EventType.METRICS, self.metrics.node_id, Severity.INFO, data))

    def _event(self, kind: EventType, severity: Severity, message: str, **data: Any) -> None:
        node = self.node.get("node_id", self.address)
        self.events.emit(ClusterEvent(kind, node, severity, {"message": message, "address": self.address, **data}))

    @property
    def health(self) -> HealthReport | None:
        """The server's own report plus what only the client sees: the network and the peer."""
        base = self.server_health
        if base is None and self.lost_reason is None:
            return None
        checks = list(base.checks) if base else []
        if self.rtt is not None:
            slow = self.rtt >= 0.5
            checks.append(
                HealthCheck(
                    "network",
                    Grade.DEGRADED if slow else Grade.HEALTHY,
                    f"network: heartbeat round trip {self.rtt * 1000:.1f} ms",
                )
            )
        lost = self.lost_reason
        checks.append(
            HealthCheck(
                "peers",
                Grade.UNHEALTHY if lost is not None else Grade.HEALTHY,
                lost if lost is not None else f"peers: {self.address} reachable",
            )
        )
        node = base.node if base else self.node.get("node_id", self.address)
        return HealthReport(node, worst([c.grade for c in checks]), checks)
