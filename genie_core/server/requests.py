"""What each request a client may send does on the server: a hello opens or attaches a session;
cells, pushes, pulls and tensor ops go to the session's worker; the rest is answered here. The
table is checked against the protocol's at start-up, so a type without a handler cannot ship."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import cast

from ..events import EventType, Severity
from ..protocol import Message, MessageType, Peer, accepted_from, contents, error_content
from ..threads import name_os_thread
from ..versions import compare, local_versions
from .admission import Admitted, Reply
from .data import DataPlane
from .session_dir import SessionDirectory, SyncError
from .sessions import Session, SessionTable, outcomes
from .telemetry import Telemetry
from .upkeep import Upkeep
from .workers import WorkerPool

log = logging.getLogger("genie.server")

T = MessageType
Handler = Callable[[Session, Message], None]


class ClientRequests:
    def __init__(
        self,
        *,
        sessions: SessionTable,
        workers: WorkerPool,
        data: DataPlane,
        telemetry: Telemetry,
        upkeep: Upkeep,
        reply: Reply,
        call_soon: Callable[[Callable[[], None]], None],
        node_info: Callable[[], contents.NodeDescription],
        address: Callable[[], str],
    ) -> None:
        self.sessions, self.workers, self.data, self.telemetry = sessions, workers, data, telemetry
        self.upkeep, self.reply, self.call_soon = upkeep, reply, call_soon
        self.node_info, self.address = node_info, address
        # Who embeds the server may hear of each cell (a pool's audit log); called on the loop thread
        self.on_cell: Callable[[Session, Message], None] | None = None
        self.handlers = self._table()

    def _table(self) -> dict[MessageType, Handler]:
        handlers: dict[MessageType, Handler] = {
            T.EXECUTE: self._on_execute,
            T.PULL: self._to_worker,
            T.TENSOR_OPS: self._with_data,
            T.PUSH: self._with_data,
            T.INTERRUPT: self._on_interrupt,
            T.OUTCOME: self._on_outcome,
            T.INFO: self._on_info,
            T.DATA_PROBE: self._on_data_probe,
            T.SET_BACKEND: self._on_set_backend,
            T.CLOSE: self._on_close,
            T.JOBS: self._on_jobs,
            T.SYNC: self._on_sync,
            T.FILE_STAT: self._on_file,
            T.FILE_PUT: self._on_file,
            T.FILE_GET: self._on_file,
        }
        unhandled = accepted_from(Peer.CLIENT) - {T.HELLO, T.PING} - set(handlers)
        assert not unhandled, f"client requests without a handler: {sorted(unhandled)}"
        return handlers

    def on_admitted(self, admitted: Admitted) -> None:
        """A message that passed admission: answer it, or hand it to its handler."""
        if admitted.session is None:
            self.on_hello(admitted.identity, admitted.msg)
        elif admitted.type is T.PING:  # on whichever connection it came (the heartbeat one, mostly)
            self.reply(admitted.identity, admitted.msg, T.PONG, contents.Pong(time=time.time()))
        else:
            self.handlers[admitted.type](admitted.session, admitted.msg)

    def on_hello(self, identity: bytes, msg: Message) -> None:
        """Open a session, or attach to the named one, unless the client's versions cannot work with
        ours (refused before anything is opened or attached: a running named session is left alone)."""
        theirs = cast(contents.Hello, msg.content).get("versions")
        if isinstance(theirs, dict):
            client = {str(k): None if v is None else str(v) for k, v in theirs.items()}
            problems = compare(client, local_versions(), self.address()).errors
            if problems:
                self.reply(identity, msg, T.ERROR_REPLY, error_content("VersionMismatch", "; ".join(problems)))
                return
        problem = self.sessions.refuse_attach(msg)
        if problem:
            self.reply(identity, msg, T.ERROR_REPLY, error_content("SessionInUse", problem))
            return
        session, attached = self.sessions.open(identity, msg, self.workers.next_slot)
        log.info("session %s %s for %s", session.id[:8], "attached" if attached else "opened", session.client)
        welcome = contents.Welcome(
            session=session.id,
            node=self.node_info(),
            slot=session.slot,
            versions=local_versions(),
            name=session.name,
            attached=attached,  # to a named session that was already running
            created=session.created,
            jobs=[j.to_dict() for j in session.jobs.running()],
            job_names=[j.name for j in session.jobs.by_id.values()],
        )
        self.reply(identity, msg, T.WELCOME, welcome)
        if attached:
            self.upkeep.event(
                session, EventType.SESSION_ATTACHED, Severity.INFO, f"session {session.name!r} attached by a client"
            )

    def _on_execute(self, session: Session, msg: Message) -> None:
        """A cell; one sent with `job` runs as a background job, whose output the session keeps."""
        if self.on_cell is not None:
            self.on_cell(session, msg)
        if "job" in cast(contents.Execute, msg.content):
            problem = session.jobs.start(msg)
            if problem:
                self._refuse(session, msg, "ValueError", problem)
                return
        self._to_worker(session, msg)

    def _directory(self, session: Session) -> SessionDirectory:
        if session.directory is None:
            session.directory = SessionDirectory(self.workers.session_root(session), self.workers.owner(session))
        return session.directory

    def _on_sync(self, session: Session, msg: Message) -> None:
        """`%genie_sync`: make the session directory hold the manifest; the reply names what is
        missing. Hashing and writing (up to tens of MiB) happen on a thread of their own, so that
        heartbeats and other sessions are answered meanwhile."""
        sync = cast(contents.Sync, msg.content)
        names = [str(n) for n in list(sync.get("files") or [])]
        if len(names) != len(msg.buffers):
            self._refuse(session, msg, "ValueError", f"{len(names)} file names for {len(msg.buffers)} contents")
            return
        directory = self._directory(session)
        manifest = dict(sync.get("manifest") or {})
        files = dict(zip(names, map(bytes, msg.buffers), strict=True))

        def apply() -> None:
            name_os_thread()
            try:
                report = directory.apply(manifest, files)
            except (SyncError, OSError) as exc:
                error = exc
                self.call_soon(lambda: self._refuse(session, msg, type(error).__name__, str(error)))
                return
            self.call_soon(lambda: self.reply(session.identity, msg, T.SYNC_REPLY, report))

        threading.Thread(target=apply, name="genie-sync", daemon=True).start()

    def _on_file(self, session: Session, msg: Message) -> None:
        """An upload's or download's step, for the worker; relative paths are in the session directory."""
        problem = self.data.check_ref(cast(contents.FilePut, msg.content).get("data"), session.id)  # a piece's bytes
        if problem:
            self._refuse(session, msg, "PermissionError", problem)
            return
        self._directory(session).root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._to_worker(session, msg)

    def _on_jobs(self, session: Session, msg: Message) -> None:
        """The session's jobs; outputs from a given number on for those asked about (`since`)."""
        asked = cast(contents.Jobs, msg.content).get("since") or {}
        since = {str(k)[:64]: int(v) for k, v in list(dict(asked).items())[:100] if isinstance(v, int)}
        self.reply(session.identity, msg, T.JOBS_REPLY, contents.JobsReply(jobs=session.jobs.report(since)))

    def _refuse(self, session: Session, msg: Message, ename: str, evalue: str) -> None:
        """Answer a request that will not run with an error (and remember that it did not)."""
        content = error_content(ename, evalue)
        session.finished(msg.id, content)
        self.reply(session.identity, msg, T.ERROR_REPLY, content)

    def _to_worker(self, session: Session, msg: Message) -> None:
        if session.directory is not None:  # the worker runs in the session directory, re-importing what changed
            directory = contents.SyncState(dir=str(session.directory.root), generation=session.directory.generation)
            cast(contents.ToWorker, msg.content)["sync"] = directory
        problem = self.workers.route(session, msg)
        if problem:
            self._refuse(session, msg, "ValueError", problem)

    def _with_data(self, session: Session, msg: Message) -> None:
        """A request whose bytes may have come over the data plane (a push, a batch of tensor ops):
        the segment it names must be this session's."""
        problem = self.data.check_ref(cast(contents.ToWorker, msg.content).get("data"), session.id)
        if problem:
            self._refuse(session, msg, "PermissionError", problem)
            return
        self._to_worker(session, msg)

    def _on_interrupt(self, session: Session, msg: Message) -> None:
        """Interrupt one cell (content "request"; none: whichever runs, or else the next to run). A
        cell still waiting for its worker to start is answered here and never runs; the worker
        judges the rest."""
        target = cast(contents.Interrupt, msg.content).get("request")
        cancelled, forwarded = self.workers.interrupt(session, str(target)[:64] if target else None)
        for request in cancelled:  # answered as its worker would have
            error, reply = contents.interrupted_before_start()
            self.reply(session.identity, request, T.ERROR, error)
            session.finished(request.id, reply)
            self.reply(session.identity, request, T.EXECUTE_REPLY, reply)
        answer = contents.InterruptReply(cancelled=len(cancelled), forwarded=forwarded)
        self.reply(session.identity, msg, T.INTERRUPT_REPLY, answer)

    def _on_outcome(self, session: Session, msg: Message) -> None:
        self.reply(session.identity, msg, T.OUTCOME_REPLY, outcomes(session, msg))

    def _on_info(self, session: Session, msg: Message) -> None:
        asked = cast(contents.Info, msg.content)
        report = self.telemetry.report(int(asked.get("history_points", 60)), int(asked.get("events", 50)))
        sessions: list[contents.SessionInfo] = [
            {**s.info(), "workers": [w.info() for w in self.workers.of(s).values()]}
            for s in self.sessions.live.values()
        ]
        info: contents.InfoReply = {"node": self.node_info(), "sessions": sessions, **report}
        self.reply(session.identity, msg, T.INFO_REPLY, info)

    def _on_data_probe(self, session: Session, msg: Message) -> None:
        """Discovery's round trip (inline bytes, or a segment the client made)."""
        ref = cast(contents.DataProbe, msg.content).get("data")
        problem = self.data.check_ref(ref, session.id)
        if problem:
            self._refuse(session, msg, "PermissionError", problem)
            return
        probed = contents.DataProbeReply(bytes=self.data.probe(ref, msg.buffers))
        self.reply(session.identity, msg, T.DATA_PROBE_REPLY, probed)

    def _on_set_backend(self, session: Session, msg: Message) -> None:
        session.backend = str(cast(contents.SetBackend, msg.content).get("backend", ""))[:32]
        self.reply(session.identity, msg, T.SET_BACKEND_REPLY, contents.SetBackendReply(ok=True))

    def _on_close(self, session: Session, msg: Message) -> None:
        self.upkeep.close(session, "closed by the client")
        self.reply(session.identity, msg, T.CLOSE_REPLY, contents.CloseReply(status="ok"))
