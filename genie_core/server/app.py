"""The genie server (node agent): one port for clients, a private socket for its workers, and the
parts that do the work: admission (who gets in), sessions, the worker pool, telemetry and the
data plane. This module binds, wires and answers client requests; it never runs user code."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import zmq

from ..config import (
    MIN_NETWORK_TOKEN,
    ClusterConfig,
    ConnectionInfo,
    is_loopback,
    new_token,
    runtime_dir,
    state_dir,
)
from ..dataplane import ServerSide
from ..dataplane.stream import DataHost
from ..errors import ConfigError
from ..events import ClusterEvent, EventType, Severity
from ..gpus import list_gpus
from ..lifeline import Lifeline, parent_gone
from ..loop import SocketLoop
from ..monitoring import GPUSource
from ..protocol import PROTOCOL_VERSION, Codec, Message, MessageType, Peer, accepted_from, derive_key, error_content
from ..sandbox import Sandbox, policy_of, require
from ..threads import name_os_thread
from ..versions import compare, local_versions
from .admission import Admission, Admitted
from .data import DataPlane
from .session_dir import SessionDirectory, SyncError
from .sessions import Session, SessionTable, outcomes
from .telemetry import Telemetry
from .workers import WorkerPool, sweep_orphans

log = logging.getLogger("genie.server")

T = MessageType
Handler = Callable[[Session, Message], None]


class Server:
    """`Server(config).start()` binds and returns; `serve_forever()` or `start_in_thread()` runs it."""

    def __init__(
        self,
        config: ClusterConfig | None = None,
        *,
        parent_lifeline: int | None = None,
        spare_workers: int | None = None,
        gpu_source: GPUSource | None = None,
    ) -> None:
        self.config = config or ClusterConfig.resolve(node_role="server")
        if (
            self.config.token is not None
            and len(self.config.token) < MIN_NETWORK_TOKEN
            and not is_loopback(self.config.ip)
        ):
            raise ConfigError(
                f"refusing to listen on {self.config.ip} with a {len(self.config.token)}-character token: "
                f"anyone who can reach the port could guess it. Use at least {MIN_NETWORK_TOKEN} characters, "
                "or leave --token out to have one generated"
            )
        self.token = self.config.token or new_token()
        self.keys: Any = None
        self.gate: Any = None
        self.limits = {
            "session_tensors": self.config.max_session_tensors,
            "session_bytes": self.config.max_session_bytes,
            "message_bytes": self.config.max_message_bytes,
        }
        self.node_id = self.config.resolved_node_id()
        self.signing_key = derive_key(self.token)  # also the data plane's
        self.codec = Codec(self.signing_key, max_bytes=self.config.max_message_bytes)
        self.parent_lifeline = parent_lifeline  # a pipe from whoever embeds us: we stop when it closes
        self.spare_workers = self.config.spare_workers if spare_workers is None else spare_workers
        detected, gpu_reason = list_gpus()
        if self.config.gpus is not None:
            by_index = {g["index"]: g for g in detected}
            self.gpus = [by_index.get(i, {"index": i, "name": "unknown"}) for i in self.config.gpus]
        else:
            self.gpus = detected
        self.telemetry = Telemetry(self.config, self.node_id, self.gpus, gpu_reason, gpu_source)
        self.telemetry.owners = self._process_owners
        self.sessions = SessionTable()
        self.port = 0
        self.connection_file: Path | None = None
        self._ctx: zmq.Context | None = None
        self._loop = SocketLoop("server")
        self._thread: threading.Thread | None = None
        self._worker_dir = ""
        self._homes_dir = ""
        self.sandbox: Sandbox | None = None
        self.sandbox_report = ""  # which protections the sandbox gives here (config.sandbox)
        self._seq = 0
        self._lifeline = Lifeline()  # every worker holds its read end
        self._handlers = self._handler_table()
        # Who embeds the server may hear of each cell (a pool's audit log); called on the loop thread
        self.on_cell: Callable[[Session, Message], None] | None = None
        self.admission = Admission(
            self.codec,
            self.sessions.live,
            self.sessions.ended,
            self._loop.call_soon,
            self._on_admitted,
            self._reply,
            self._send_raw,
        )

    @property
    def bus(self) -> Any:
        return self.telemetry.bus

    @property
    def monitor(self) -> Any:
        return self.telemetry.monitor

    @property
    def address(self) -> str:
        return f"genie://{self.config.ip}:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------
    def _homes(self) -> Path | None:
        """Where sandboxed sessions' directories go: a folder their uids may pass through (0711)
        but not list, apart from the workers' folder (0700: its socket)."""
        if self.sandbox is None:
            return None
        self._homes_dir = tempfile.mkdtemp(prefix="genie-homes-")
        os.chmod(self._homes_dir, 0o711)
        self.sandbox.hide(Path(self._homes_dir))
        return Path(self._homes_dir)

    def _make_sandbox(self) -> Sandbox | None:
        """The sandbox sessions' workers start in (config.sandbox), or ConfigError naming each
        protection this machine cannot give, unless the admin allowed that (allow_unisolated)."""
        if not self.config.sandbox:
            return None
        sandbox = Sandbox(policy_of(self.config))
        require(sandbox.protections, self.config.allow_unisolated)
        self.sandbox_report = sandbox.report()
        if not sandbox.on["processes and files"]:
            return None  # allowed to run without it: workers start as without --sandbox (the report says so)
        extra = [Path(p.strip()) for p in (self.config.sandbox_hide or "").split(",") if p.strip()]
        state = state_dir(self.node_id, self.config.state_dir).parent  # every node's state, a pool's registry
        for path in (runtime_dir(), state, *extra):
            sandbox.hide(path)
        return sandbox

    def start(self) -> Server:
        self.sandbox = self._make_sandbox()
        ctx = self._ctx = zmq.Context()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its routing id
        self.router.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        if ":" in self.config.ip:
            self.router.setsockopt(zmq.IPV6, 1)
        if self.config.encrypt:
            from ..encryption import KeyGate, Keys, secure_server

            self.keys = Keys()
            self.gate = KeyGate(ctx, {self.keys.client_public})
            secure_server(self.router, self.keys)
        host = f"[{self.config.ip}]" if ":" in self.config.ip else self.config.ip
        try:
            if self.config.master_port == 0:
                self.port = self.router.bind_to_random_port(f"tcp://{host}")
            else:
                self.router.bind(f"tcp://{host}:{self.config.master_port}")
                self.port = self.config.master_port
        except zmq.ZMQError as exc:
            self.router.close()
            if self.gate is not None:
                self.gate.stop()
            ctx.term()
            raise ConfigError(f"cannot listen on {self.config.ip}:{self.config.master_port}: {exc.strerror}") from None
        self._worker_dir = tempfile.mkdtemp(prefix="genie-")  # 0700: only we can reach the workers
        worker_router = ctx.socket(zmq.ROUTER)
        worker_router.setsockopt(zmq.LINGER, 0)
        worker_router.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)  # sandboxed cells can reach it
        endpoint = f"ipc://{self._worker_dir}/workers"
        worker_router.bind(endpoint)
        if self.sandbox is not None:
            self.sandbox.hide(Path(self._worker_dir))
            self.sandbox.expose(Path(self._worker_dir) / "workers")
            os.chmod(Path(self._worker_dir) / "workers", 0o666)  # sessions' uids; the folder stays 0700
            self.sandbox.start()
        self.pool = WorkerPool(
            worker_router,
            endpoint,
            self._lifeline.fd,
            self.limits,
            self.gpus,
            self.spare_workers,
            self._from_worker,
            self.address,
            self.sandbox,
            self._homes(),
        )
        self.pool.sessions = self.sessions.live
        self._loop.add_socket(self.router, self._on_client_readable)
        self._loop.add_socket(worker_router, self.pool.on_readable)
        if self.parent_lifeline is not None:
            self._loop.add_socket(self.parent_lifeline, self._on_parent_gone)
        sweep_orphans()
        self._loop.call_every(0.2, self._housekeeping)
        info = ConnectionInfo(
            self.config.ip,
            self.port,
            self.token,
            self.node_id,
            os.getpid(),
            PROTOCOL_VERSION,
            self.keys.for_clients() if self.keys else None,
        )
        path = self.config.connection_file or runtime_dir() / f"genie-server-{self.node_id}-{self.port}.json"
        self.connection_file = info.write(path)
        if self.sandbox is not None:
            empty = Path(self._worker_dir) / "empty"
            empty.touch(mode=0o444)
            self.sandbox.mask(self.connection_file, empty)
        self.telemetry.start(self.address, self._broadcast)
        max_put = min(self.config.max_session_bytes or self.config.max_message_bytes, self.config.max_message_bytes)
        self.data = DataPlane(
            ServerSide(
                self.config.ip,
                self.port,
                fixed_port=bool(self.config.master_port),
                data_port=self.config.data_port,
                host=DataHost(self.signing_key, self.pool.worker_pids, max_put=max_put),
                encrypted=self.config.encrypt,
                enable_ucx=self.config.enable_ucx,
            )
        )
        self.data.start()
        self.pool.refill_spares()
        return self

    def ready_line(self) -> str:
        gpus = (
            f"{len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}"
            if self.gpus
            else f"no GPU: {self.telemetry.gpu_reason}"
        )
        return (
            f"genie server ready at {self.address} (node {self.node_id}, {gpus}); "
            f"connection file: {self.connection_file}"
        )

    def node_info(self) -> dict[str, Any]:
        return self.telemetry.node_info(self.address, self.data.info if hasattr(self, "data") else {}, self.limits)

    def serve_forever(self) -> None:
        try:
            self._loop.run()
        finally:
            self._cleanup()

    def start_in_thread(self) -> Server:
        self._thread = threading.Thread(target=self.serve_forever, name="genie-server", daemon=True)
        self._thread.start()
        return self

    def wait_stopped(self, timeout: float) -> bool:
        """Whether the server, run by `start_in_thread`, has stopped serving (waits up to `timeout` s)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Thread-safe; returns once workers are ended and the port is closed (when run in a thread)."""
        self._loop.stop(join=False)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _cleanup(self) -> None:
        """On the loop thread, as it ends (the loop then closes the sockets and ends the context)."""
        self.data.stop()
        if self.gate is not None:
            self.gate.stop()
        self.admission.close()
        self.telemetry.stop()
        self.pool.stop_all()
        if self.sandbox is not None:
            self.sandbox.stop()
        self.router.close()
        self.pool.sock.close()
        if self._ctx is not None:
            self._ctx.term()
        if self.connection_file is not None:
            self.connection_file.unlink(missing_ok=True)
        shutil.rmtree(self._worker_dir, ignore_errors=True)
        if self._homes_dir:
            shutil.rmtree(self._homes_dir, ignore_errors=True)
        self._lifeline.close()

    def _on_parent_gone(self, fd: int) -> None:
        if parent_gone(fd):
            log.warning("the process that started this server is gone; stopping")
            self._loop.remove_socket(fd)
            self._loop.stop(join=False)

    def _process_owners(self) -> dict[int, dict[str, Any]]:
        """pid -> the session whose worker it is, or whose worker started it (any thread: it reads
        snapshots of the session and worker tables)."""
        owners: dict[int, dict[str, Any]] = {}
        for session in list(self.sessions.live.values()):
            label = {
                "session": session.id[:8],
                "name": session.name,
                "user": session.client.get("user", ""),
                "host": session.client.get("host", ""),
            }
            owners.update((worker.pid, label) for worker in list(self.pool.of(session).values()))
        if not owners:
            return owners
        children: dict[int, list[int]] = {}  # one pass over the process table, not one per worker
        for proc in psutil.process_iter(["ppid"]):
            children.setdefault(proc.info["ppid"] or 0, []).append(proc.pid)
        todo = list(owners)
        while todo:
            parent = todo.pop()
            for child in children.get(parent, []):
                if child not in owners:
                    owners[child] = owners[parent]
                    todo.append(child)
        return owners

    def _housekeeping(self) -> None:
        self.pool.housekeeping()
        lease = self.config.session_lease
        expired = self.sessions.expired(lease)
        for session in expired:
            if not session.name:
                self._close_session(session, f"no message from the client for {lease:.0f} s")
            elif not session.detached:  # a named session waits for a client to attach
                session.detached = True
                self._session_event(
                    session,
                    EventType.SESSION_DETACHED,
                    Severity.WARNING,
                    f"session {session.name!r} has had no client for {lease:.0f} s; it keeps running "
                    "until a client attaches (%genie_init ADDR --session NAME)"
                    + (f" or it has been idle {self.config.idle_timeout:.0f} s" if self.config.idle_timeout else ""),
                )
        for session in self.sessions.live.values():
            if session.detached and session not in expired:
                session.detached = False  # its client spoke again (a partition healed)
        if self.config.idle_timeout > 0:
            self._cull_idle(self.config.idle_timeout)

    def _cull_idle(self, limit: float) -> None:
        """End sessions with no client and nothing running for `limit` seconds, after a warning
        event at 80% of it. A session with a running cell or job is never idle."""
        lease, now = self.config.session_lease, time.monotonic()
        for session in list(self.sessions.live.values()):
            busy = any(w.inflight for w in self.pool.of(session).values())
            if busy or session.jobs.running() or not session.detached:
                session.quiet_since, session.idle_warned = now, False
                continue
            idle = now - max(session.quiet_since, session.last_seen + lease)  # no client, nothing running
            if idle >= limit:
                self._close_session(session, f"idle: no client and nothing running for {limit:.0f} s")
            elif idle >= 0.8 * limit and not session.idle_warned:
                session.idle_warned = True
                self._session_event(
                    session,
                    EventType.SESSION_IDLE,
                    Severity.WARNING,
                    f"session {session.name or session.id[:8]!r} has been idle {idle:.0f} s: it ends in "
                    f"{limit - idle:.0f} s unless a client attaches",
                )

    def _session_event(self, session: Session, kind: EventType, severity: Severity, message: str) -> None:
        self.bus.emit(
            ClusterEvent(
                kind, self.node_id, severity, {"session": session.id[:8], "name": session.name, "message": message}
            )
        )

    # -- sending --------------------------------------------------------------------------
    def _send(self, identity: bytes, msg: Message) -> None:
        self._seq += 1
        msg.seq = self._seq
        self.router.send_multipart([identity, *self.codec.pack(msg)], copy=False)

    def _reply(
        self, identity: bytes, request: Message, kind: str, content: dict[str, Any], buffers: list[Any] | None = None
    ) -> None:
        self._send(identity, Message(kind, content, buffers or [], parent=request.id, session=request.session))

    def _send_raw(self, identity: bytes, frames: list[Any]) -> None:
        self.router.send_multipart([identity, *frames])

    def _broadcast(self, kind: MessageType, content: dict[str, Any]) -> None:
        """Events and readings to every session's heartbeat connection (from any thread)."""

        def send() -> None:
            for session in list(self.sessions.live.values()):
                self._send(session.event_identity, Message(kind, content, session=session.id))

        self._loop.call_soon(send)

    def _from_worker(self, session: Session, msg: Message) -> None:
        session.jobs.record(msg)
        self._send(session.identity, Message(msg.type, msg.content, msg.buffers, parent=msg.parent, session=session.id))

    # -- client requests ------------------------------------------------------------------
    def _on_client_readable(self, sock: zmq.Socket) -> None:
        for _ in range(64):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.admission.on_frames(frames)

    def _on_admitted(self, admitted: Admitted) -> None:
        """A message that passed admission: answer it, or hand it to its handler."""
        if admitted.session is None:
            self._on_hello(admitted.identity, admitted.msg)
        elif admitted.type is T.PING:  # on whichever connection it came (the heartbeat one, mostly)
            self._reply(admitted.identity, admitted.msg, T.PONG, {"time": time.time()})
        else:
            self._handlers[admitted.type](admitted.session, admitted.msg)

    def _handler_table(self) -> dict[MessageType, Handler]:
        """What each request a client may send does; checked against the protocol's table, so a
        type without a handler is caught at start-up and nothing is ever looked up by name."""
        handlers: dict[MessageType, Handler] = {
            T.EXECUTE: self._on_execute,
            T.PULL: self._to_worker,
            T.TENSOR_OPS: self._to_worker,
            T.PUSH: self._on_push,
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

    def _on_hello(self, identity: bytes, msg: Message) -> None:
        """Open a session, or attach to the named one, unless the client's versions cannot work with
        ours (refused before anything is opened or attached: a running named session is left alone)."""
        theirs = msg.content.get("versions")
        if isinstance(theirs, dict):
            client = {str(k): None if v is None else str(v) for k, v in theirs.items()}
            problems = compare(client, local_versions(), self.address).errors
            if problems:
                self._reply(identity, msg, T.ERROR_REPLY, error_content("VersionMismatch", "; ".join(problems)))
                return
        problem = self.sessions.refuse_attach(msg)
        if problem:
            self._reply(identity, msg, T.ERROR_REPLY, error_content("SessionInUse", problem))
            return
        session, attached = self.sessions.open(identity, msg, self.pool.next_slot)
        log.info("session %s %s for %s", session.id[:8], "attached" if attached else "opened", session.client)
        welcome = {
            "session": session.id,
            "node": self.node_info(),
            "slot": session.slot,
            "versions": local_versions(),
            "name": session.name,
            "attached": attached,  # to a named session that was already running
            "created": session.created,
            "jobs": [j.to_dict() for j in session.jobs.running()],
            "job_names": [j.name for j in session.jobs.by_id.values()],
        }
        self._reply(identity, msg, T.WELCOME, welcome)
        if attached:
            self._session_event(
                session, EventType.SESSION_ATTACHED, Severity.INFO, f"session {session.name!r} attached by a client"
            )

    def _on_execute(self, session: Session, msg: Message) -> None:
        """A cell; one sent with `job` runs as a background job, whose output the session keeps."""
        if self.on_cell is not None:
            self.on_cell(session, msg)
        if "job" in msg.content:
            problem = session.jobs.start(msg)
            if problem:
                self._refuse(session, msg, "ValueError", problem)
                return
        self._to_worker(session, msg)

    def _directory(self, session: Session) -> SessionDirectory:
        if session.directory is None:
            root = self.pool.home(session) or Path(self._worker_dir) / f"session-{session.id[:16]}"
            session.directory = SessionDirectory(root, self.pool.owner(session))
        return session.directory

    def _on_sync(self, session: Session, msg: Message) -> None:
        """`%genie_sync`: make the session directory hold the manifest; the reply names what is
        missing. Hashing and writing (up to tens of MiB) happen on a thread of their own, so that
        heartbeats and other sessions are answered meanwhile."""
        names = [str(n) for n in list(msg.content.get("files") or [])]
        if len(names) != len(msg.buffers):
            self._refuse(session, msg, "ValueError", f"{len(names)} file names for {len(msg.buffers)} contents")
            return
        directory = self._directory(session)
        manifest = dict(msg.content.get("manifest") or {})
        contents = dict(zip(names, map(bytes, msg.buffers), strict=True))

        def apply() -> None:
            name_os_thread()
            try:
                report = directory.apply(manifest, contents)
            except (SyncError, OSError) as exc:
                error = exc
                self._loop.call_soon(lambda: self._refuse(session, msg, type(error).__name__, str(error)))
                return
            self._loop.call_soon(lambda: self._reply(session.identity, msg, T.SYNC_REPLY, report))

        threading.Thread(target=apply, name="genie-sync", daemon=True).start()

    def _on_file(self, session: Session, msg: Message) -> None:
        """An upload's or download's step, for the worker; relative paths are in the session directory."""
        problem = self.data.check_ref(msg.content.get("data"), session.id)
        if problem:
            self._refuse(session, msg, "PermissionError", problem)
            return
        self._directory(session).root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._to_worker(session, msg)

    def _on_jobs(self, session: Session, msg: Message) -> None:
        """The session's jobs; outputs from a given number on for those asked about (`since`)."""
        asked = msg.content.get("since") or {}
        since = {str(k)[:64]: int(v) for k, v in list(dict(asked).items())[:100] if isinstance(v, int)}
        self._reply(session.identity, msg, T.JOBS_REPLY, {"jobs": session.jobs.report(since)})

    def _refuse(self, session: Session, msg: Message, ename: str, evalue: str) -> None:
        """Answer a request that will not run with an error (and remember that it did not)."""
        content = error_content(ename, evalue)
        session.finished(msg.id, content)
        self._reply(session.identity, msg, T.ERROR_REPLY, content)

    def _to_worker(self, session: Session, msg: Message) -> None:
        if session.directory is not None:  # the worker runs in the session directory, re-importing what changed
            msg.content["sync"] = {"dir": str(session.directory.root), "generation": session.directory.generation}
        problem = self.pool.route(session, msg)
        if problem:
            self._refuse(session, msg, "ValueError", problem)

    def _on_push(self, session: Session, msg: Message) -> None:
        problem = self.data.check_ref(msg.content.get("data"), session.id)
        if problem:
            self._refuse(session, msg, "PermissionError", problem)
            return
        self._to_worker(session, msg)

    def _on_interrupt(self, session: Session, msg: Message) -> None:
        """Interrupt one cell (content "request"; none: whichever runs). A cell still waiting for
        its worker to start is answered here and never runs; the worker judges the rest."""
        target = msg.content.get("request")
        cancelled, forwarded = self.pool.interrupt(session, str(target)[:64] if target else None)
        evalue = "interrupted before it started: the cell did not run"
        for request in cancelled:  # answered as its worker would have
            self._reply(
                session.identity,
                request,
                T.ERROR,
                error_content("KeyboardInterrupt", evalue, [f"KeyboardInterrupt: {evalue}"]),
            )
            content = {"status": "error", "ename": "KeyboardInterrupt", "evalue": evalue, "ran": False}
            session.finished(request.id, content)
            self._reply(session.identity, request, T.EXECUTE_REPLY, content)
        self._reply(session.identity, msg, T.INTERRUPT_REPLY, {"cancelled": len(cancelled), "forwarded": forwarded})

    def _on_outcome(self, session: Session, msg: Message) -> None:
        self._reply(session.identity, msg, T.OUTCOME_REPLY, outcomes(session, msg))

    def _on_info(self, session: Session, msg: Message) -> None:
        report = self.telemetry.report(int(msg.content.get("history_points", 60)), int(msg.content.get("events", 50)))
        sessions = [
            dict(s.info(), workers=[w.info() for w in self.pool.of(s).values()]) for s in self.sessions.live.values()
        ]
        self._reply(session.identity, msg, T.INFO_REPLY, {"node": self.node_info(), "sessions": sessions, **report})

    def _on_data_probe(self, session: Session, msg: Message) -> None:
        """Discovery's round trip (inline bytes, or a segment the client made)."""
        ref = msg.content.get("data")
        problem = self.data.check_ref(ref, session.id)
        if problem:
            self._refuse(session, msg, "PermissionError", problem)
            return
        self._reply(session.identity, msg, T.DATA_PROBE_REPLY, {"bytes": self.data.probe(ref, msg.buffers)})

    def _on_set_backend(self, session: Session, msg: Message) -> None:
        session.backend = str(msg.content.get("backend", ""))[:32]
        self._reply(session.identity, msg, T.SET_BACKEND_REPLY, {"ok": True})

    def _on_close(self, session: Session, msg: Message) -> None:
        self._close_session(session, "closed by the client")
        self._reply(session.identity, msg, T.CLOSE_REPLY, {"status": "ok"})

    def _close_session(self, session: Session, why: str) -> None:
        log.info("session %s closed: %s", session.id[:8], why)
        self.sessions.end(session, why)
        if session.client.get("purpose") != "probe":
            self.bus.emit(
                ClusterEvent(
                    EventType.SESSION_CLOSED,
                    self.node_id,
                    Severity.INFO,
                    {
                        "session": session.id[:8],
                        "client": session.client,
                        "message": f"session {session.id[:8]} closed: {why}",
                    },
                )
            )
        self.pool.release(session)
        if session.directory is not None:
            session.directory.remove()


def run_server(config: ClusterConfig, parent_lifeline: int | None = None) -> int:
    """`genie serve`: start, print the ready line, serve until SIGINT/SIGTERM."""
    import signal

    from .allocator import map_large_blocks

    map_large_blocks()  # only in a server process of its own: it changes malloc for the whole process
    server = Server(config, parent_lifeline=parent_lifeline).start()

    def _stop(signum: int, frame: Any) -> None:
        server._loop.stop(join=False)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(server.ready_line(), flush=True)
    if server.sandbox_report:
        print(server.sandbox_report, flush=True)
    if not is_loopback(config.ip) and not config.encrypt:
        print(
            f"WARNING: listening on {config.ip} WITHOUT ENCRYPTION: messages are signed, but code, outputs and data "
            "are readable by anyone on the network path. Use `genie serve --encrypt`, or 127.0.0.1 and an SSH tunnel.",
            file=sys.stderr,
            flush=True,
        )
    server.serve_forever()
    print("genie server stopped", flush=True)
    return 0
