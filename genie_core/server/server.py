"""The genie server (node agent): authenticates clients, keeps their sessions, routes their
requests to per-session worker processes, and answers heartbeats. It never runs user code."""

from __future__ import annotations

import logging
import os
import hashlib
import platform
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import zmq

from .. import __version__
from ..config import MIN_NETWORK_TOKEN, ClusterConfig, ConnectionInfo, is_loopback, new_token, runtime_dir, state_dir
from ..errors import ConfigError, ProtocolError
from ..events import ClusterEvent, EventBus, EventType, Severity
from ..gpus import list_gpus
from ..lifeline import Lifeline, parent_gone
from ..loop import SocketLoop
from ..monitoring import GPUSource, NvmlSource, SimulatedGPUSource, create_resource_monitor
from ..monitoring.history_store import HistoryStore
from ..nodes import NodeInfo
from ..transport import detect
from ..transport.data_server import DataServer
from ..transport.segment import SHM_DIR, Segment, shm_available, sweep_dead, sweep_worker
from ..protocol import PROTOCOL_VERSION, TERMINAL, Codec, Message, MessageType, Peer, accepted_from, derive_key, parse
from .admission import Admission, Admitted
from .session import Session
from .worker_process import CPU, WorkerProcess, describe_exit, sweep_orphans

log = logging.getLogger("genie.server")

T = MessageType
ENDED_REMEMBERED = 64  # ended sessions whose request records are kept


class Server:
    """`Server(config).start()` binds and returns; `serve_forever()` or `start_in_thread()` runs it."""

    def __init__(
        self, config: ClusterConfig | None = None, *, parent_lifeline: int | None = None, spare_workers: int | None = None,
        gpu_source: GPUSource | None = None,
    ) -> None:
        self.config = config or ClusterConfig.resolve(node_role="server")
        if self.config.token is not None and len(self.config.token) < MIN_NETWORK_TOKEN and not is_loopback(self.config.ip):
            raise ConfigError(
                f"refusing to listen on {self.config.ip} with a {len(self.config.token)}-character token: anyone who can reach "
                f"the port could guess it. Use at least {MIN_NETWORK_TOKEN} characters, or leave --token out to have one generated"
            )
        self.token = self.config.token or new_token()
        self.keys = self.gate = None
        self.limits = {"session_tensors": self.config.max_session_tensors, "session_bytes": self.config.max_session_bytes,
                       "message_bytes": self.config.max_message_bytes}
        self.max_put = min(self.config.max_session_bytes or self.config.max_message_bytes, self.config.max_message_bytes)
        self.node_id = self.config.resolved_node_id()
        self.codec = Codec(derive_key(self.token), max_bytes=self.config.max_message_bytes)
        self.worker_codec = Codec(key=None)
        self.parent_lifeline = parent_lifeline  # a pipe from whoever embeds us: we stop when it closes
        self.spare_workers = self.config.spare_workers if spare_workers is None else spare_workers
        detected, self.gpu_reason = list_gpus()
        if self.config.gpus is not None:
            by_index = {g["index"]: g for g in detected}
            self.gpus = [by_index.get(i, {"index": i, "name": "unknown"}) for i in self.config.gpus]
        else:
            self.gpus = detected
        self.sessions: dict[str, Session] = {}
        self.ended_sessions: OrderedDict[str, Session] = OrderedDict()  # recently ended, for "did it run?"
        self.workers: dict[str, WorkerProcess] = {}
        self.spares: list[WorkerProcess] = []
        self.dying: list[WorkerProcess] = []
        self.started = time.time()
        self.port = 0
        self.connection_file: Path | None = None
        self._ctx: zmq.Context | None = None
        self._loop = SocketLoop("server")
        self._thread: threading.Thread | None = None
        self._worker_dir = ""
        self._seq = 0
        self._stopped = threading.Event()
        self.bus = EventBus()
        self.monitor = None
        self.store: HistoryStore | None = None
        self._gpu_source = gpu_source
        self._lifeline = Lifeline()  # every worker holds its read end
        self._handlers = self._handler_table()
        self.admission = Admission(self.codec, self.sessions, self.ended_sessions, self._loop.call_soon, self._on_admitted,
                                   self._reply_to, self._send_raw)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "Server":
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
        self.worker_router = ctx.socket(zmq.ROUTER)
        self.worker_router.setsockopt(zmq.LINGER, 0)
        self.worker_endpoint = f"ipc://{self._worker_dir}/workers"
        self.worker_router.bind(self.worker_endpoint)
        self._loop.add_socket(self.router, self._on_client_readable)
        self._loop.add_socket(self.worker_router, self._on_worker_readable)
        if self.parent_lifeline is not None:
            self._loop.add_socket(self.parent_lifeline, self._on_parent_gone)
        sweep_orphans()
        self._loop.call_every(0.2, self._housekeeping)
        info = ConnectionInfo(self.config.ip, self.port, self.token, self.node_id, os.getpid(), PROTOCOL_VERSION,
                              self.keys.for_clients() if self.keys else None)
        path = self.config.connection_file or runtime_dir() / f"genie-server-{self.node_id}-{self.port}.json"
        self.connection_file = info.write(path)
        self._start_monitoring()
        self._start_data_plane()
        self._refill_spares()
        return self

    def _start_data_plane(self) -> None:
        """The tcp data port, a same-host probe for shm, and what this machine's hardware offers."""
        port = self.config.data_port
        if port is None:
            port = self.port + 1 if self.config.master_port else 0
        self.data_owners: dict[str, str] = {}  # segments filled by the tcp and ucx listeners -> session
        self.data_server: DataServer | None = None
        self.ucx_server = None
        self._shm_probe: Path | None = None
        if not self.config.encrypt:  # raw data ports carry no encryption: then data goes over CURVE (zmq) or same-host shm
            try:
                self.data_server = DataServer(self.config.ip, port, self.codec.key, self._session_worker_pids, self.data_owners,
                                              max_put=self.max_put).start()
            except OSError as exc:
                log.warning("no tcp data plane: cannot listen on %s:%s (%s)", self.config.ip, port, exc.strerror)
        probe = None
        if shm_available()[0]:
            sweep_dead()
            nonce = os.urandom(32)
            path = SHM_DIR / f"genie-probe-{os.getpid()}-{os.urandom(6).hex()}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(nonce)
            self._shm_probe = path
            probe = {"name": path.name, "sha256": hashlib.sha256(nonce).hexdigest()}
        self.transport_info = {"data_port": self.data_server.port if self.data_server else None, "ucx_port": None,
                               "shm_probe": probe, "detect": {}, "encrypted": self.config.encrypt}
        # Hardware detection and UCX (importing ucxx takes about a second) happen after we are ready.
        threading.Thread(target=self._start_slow_backends, name="genie-detect", daemon=True).start()

    def _start_slow_backends(self) -> None:
        report = detect.server_report(with_ucx=self.config.enable_ucx)
        if report["ucx"]["available"] and not self.config.encrypt:
            try:
                from ..transport.ucx import UcxDataServer

                self.ucx_server = UcxDataServer(self.codec.key, self._session_worker_pids, self.data_owners, max_put=self.max_put)
                self.transport_info["ucx_port"] = self.ucx_server.port
            except Exception as exc:
                log.warning("no ucx data plane: %s", exc)
        self.transport_info["detect"] = report

    def _session_worker_pids(self, session_id: str) -> list[int] | None:
        """For the data port (its threads): the session's worker pids, or None if no such session."""
        session = self.sessions.get(session_id)
        return None if session is None else [w.pid for w in list(session.workers.values())]

    def _start_monitoring(self) -> None:
        self.bus.subscribe(self._on_event)
        if not self.config.enable_gpu_monitoring:
            return
        folder = state_dir(self.node_id, self.config.state_dir)
        try:
            self.store = HistoryStore(folder / "history.sqlite")
            self.bus.preload(self.store.events(200))
        except Exception as exc:  # a read-only home must not stop the server
            log.warning("metric history will not survive a restart: %s", exc)
        source = self._gpu_source
        if source is None:
            source = SimulatedGPUSource(self.config.simulate_gpus) if self.config.simulate_gpus else NvmlSource(indices=self.config.gpus)
        local = NodeInfo(self.node_id, socket.gethostname(), "server", self.address, "tcp", disk_path=str(folder))
        self.monitor = create_resource_monitor(local, self.config, bus=self.bus, gpu_source=source, store=self.store, on_reading=self._on_reading)
        self.monitor.start()

    def _on_reading(self, node: NodeInfo) -> None:
        """Monitor thread: hand the snapshot to the loop thread, which owns the socket."""
        health = self.monitor.health_report if self.monitor is not None else None
        content = {"node": node.to_dict(), "health": health.to_dict() if health else None}
        self._loop.call_soon(lambda: self._broadcast("metrics", content))

    def _on_event(self, event: ClusterEvent) -> None:
        if self.store is not None and event.type is not EventType.METRICS:
            try:
                self.store.add_event(event)
            except Exception:
                log.exception("could not store an event")
        content = event.to_dict()
        self._loop.call_soon(lambda: self._broadcast("event", content))

    def _broadcast(self, kind: str, content: dict[str, Any]) -> None:
        for session in list(self.sessions.values()):
            self._send(session.event_identity, Message(kind, content, session=session.id))

    @property
    def address(self) -> str:
        return f"genie://{self.config.ip}:{self.port}"

    def ready_line(self) -> str:
        gpus = f"{len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}" if self.gpus else f"no GPU: {self.gpu_reason}"
        return f"genie server ready at {self.address} (node {self.node_id}, {gpus}); connection file: {self.connection_file}"

    def serve_forever(self) -> None:
        try:
            self._loop.run()
        finally:
            self._cleanup()

    def start_in_thread(self) -> "Server":
        self._thread = threading.Thread(target=self.serve_forever, name="genie-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Thread-safe; returns once workers are ended and the port is closed (when run in a thread)."""
        self._loop.stop(join=False)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _cleanup(self) -> None:
        if getattr(self, "data_server", None) is not None:
            self.data_server.stop()
        if getattr(self, "ucx_server", None) is not None:
            self.ucx_server.stop()
        if self.gate is not None:
            self.gate.stop()
        if getattr(self, "_shm_probe", None) is not None:
            self._shm_probe.unlink(missing_ok=True)
        self.admission.close()
        if self.monitor is not None:
            self.monitor.stop()
        if self.store is not None:
            self.store.close()
        procs = list(self.workers.values()) + self.spares + self.dying
        for w in procs:
            w.stop()
        deadline = time.monotonic() + 3.0
        for w in procs:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except Exception:
                w.kill()
                w.proc.wait()
            w.reap()
            sweep_worker(w.pid)
        self.router.close()
        self.worker_router.close()
        if self._ctx is not None:
            self._ctx.term()
        if self.connection_file is not None:
            self.connection_file.unlink(missing_ok=True)
        shutil.rmtree(self._worker_dir, ignore_errors=True)
        self._lifeline.close()
        self._stopped.set()

    # -- clients --------------------------------------------------------------------------
    def _send(self, identity: bytes, msg: Message) -> None:
        self._seq += 1
        msg.seq = self._seq
        self.router.send_multipart([identity, *self.codec.pack(msg)], copy=False)

    def _reply(self, identity: bytes, request: Message, kind: str, content: dict[str, Any], buffers: list[Any] | None = None) -> None:
        self._send(identity, Message(kind, content, buffers or [], parent=request.id, session=request.session))

    def _reply_to(self, identity: bytes, request: Message, kind: str, content: dict[str, Any]) -> None:
        self._reply(identity, request, kind, content)

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

    def _handler_table(self) -> dict[MessageType, Callable[[Session, Message], None]]:
        """What each request a client may send does; built from the protocol's table, so a type
        without a handler is caught at start-up and nothing is ever looked up by name."""
        handlers: dict[MessageType, Callable[[Session, Message], None]] = {
            T.EXECUTE: self._to_worker, T.PULL: self._to_worker, T.TENSOR_OPS: self._to_worker, T.PUSH: self._on_push,
            T.INTERRUPT: self._on_interrupt, T.OUTCOME: self._on_outcome, T.INFO: self._on_info,
            T.DATA_PROBE: self._on_data_probe, T.SET_BACKEND: self._on_set_backend, T.CLOSE: self._on_close,
        }
        unhandled = accepted_from(Peer.CLIENT) - {T.HELLO, T.PING} - set(handlers)
        assert not unhandled, f"client requests without a handler: {sorted(unhandled)}"
        return handlers

    def _send_raw(self, identity: bytes, frames: list[Any]) -> None:
        self.router.send_multipart([identity, *frames])

    def _on_hello(self, identity: bytes, msg: Message) -> None:
        client = msg.content.get("client") or {}
        try:
            heartbeat = bytes.fromhex(str(msg.content.get("heartbeat") or ""))[:255] or None
        except ValueError:
            heartbeat = None
        if heartbeat == identity:
            heartbeat = None
        session = Session(identity, {k: str(v)[:200] for k, v in dict(client).items()}, self._next_slot(), heartbeat)
        session.accept_seq(identity, msg.seq)
        self.sessions[session.id] = session
        log.info("session %s opened for %s", session.id[:8], session.client)
        self._reply(identity, msg, "welcome", {"session": session.id, "node": self.node_info(), "slot": session.slot})

    def node_info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "hostname": socket.gethostname(),
            "address": self.address,
            "pid": os.getpid(),
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "gpus": self.gpus,
            "gpu_reason": self.gpu_reason,
            "transport": getattr(self, "transport_info", {}),
            "encrypted": self.config.encrypt,
            "limits": self.limits,
            "started": self.started,
        }

    def _on_info(self, session: Session, msg: Message) -> None:
        monitor = self.monitor
        latest = monitor.latest if monitor is not None else None
        health = monitor.health_report if monitor is not None else None
        self._reply(session.identity, msg, "info_reply", {
            "node": self.node_info(),
            "metrics": latest.to_dict() if latest else None,
            "health": health.to_dict() if health else None,
            "history": monitor.history_all(points=int(msg.content.get("history_points", 60))) if monitor else {},
            "events": [e.to_dict() for e in self.bus.history(limit=int(msg.content.get("events", 50)))],
            "sessions": [s.info() for s in self.sessions.values()],
            "monitoring": {"enabled": monitor is not None, "interval": self.config.gpu_poll_interval,
                           "source": getattr(monitor.gpu_source, "name", "") if monitor else ""},
        })

    def _on_close(self, session: Session, msg: Message) -> None:
        self._close_session(session, "closed by the client")
        self._reply(session.identity, msg, "close_reply", {"status": "ok"})

    def _on_interrupt(self, session: Session, msg: Message) -> None:
        """Interrupt one cell (content "request"; none: whichever runs). A cell still waiting for
        its worker to start is answered here and never runs; the worker judges the rest."""
        target = msg.content.get("request")
        target = str(target)[:64] if target else None
        cancelled = forwarded = 0
        for worker in session.workers.values():
            for waiting in [m for m in worker.waiting if m.type == "execute" and target in (None, m.id)]:
                worker.waiting.remove(waiting)
                worker.inflight.pop(waiting.id, None)
                self._cancel(session, waiting)
                cancelled += 1
            if worker.ready:
                self._forward_to_worker(worker, Message("interrupt", {"request": target}))
                forwarded += 1
        self._reply(session.identity, msg, "interrupt_reply", {"cancelled": cancelled, "forwarded": forwarded})

    def _cancel(self, session: Session, request: Message) -> None:
        """Answer a cell interrupted before it started, as its worker would have."""
        evalue = "interrupted before it started: the cell did not run"
        self._reply(session.identity, request, "error", {"ename": "KeyboardInterrupt", "evalue": evalue,
                                                         "traceback": [f"KeyboardInterrupt: {evalue}"]})
        content = {"status": "error", "ename": "KeyboardInterrupt", "evalue": evalue, "ran": False}
        session.finished(request.id, content)
        self._reply(session.identity, request, "execute_reply", content)

    def _on_outcome(self, session: Session, msg: Message) -> None:
        self._reply(session.identity, msg, "outcome_reply", self._outcomes(session, msg))

    @staticmethod
    def _outcomes(session: Session, msg: Message) -> dict[str, Any]:
        """"Did it run?": for each request id, running, finished (with status), stopped, or not received."""
        ids = [str(i)[:64] for i in list(msg.content.get("ids") or [])[:1000]]
        return {"outcomes": {i: session.outcome(i) for i in ids}}

    def _on_push(self, session: Session, msg: Message) -> None:
        problem = self._check_data_ref(session, msg.content.get("data"))
        if problem:
            self._refuse(session, msg, "PermissionError", problem)
            return
        self._to_worker(session, msg)

    def _refuse(self, session: Session, msg: Message, ename: str, evalue: str) -> None:
        """Answer a request that will not run with an error (and remember that it did not)."""
        content = {"ename": ename, "evalue": evalue}
        session.finished(msg.id, content)
        self._reply(session.identity, msg, "error_reply", content)

    def _check_data_ref(self, session: Session, ref: Any) -> str:
        """A pushed segment must be this session's: one its data connection filled (tcp), or a
        client segment on this host (shm: same user, who can read our /dev/shm files anyway)."""
        if not ref:
            return ""
        name = str(ref.get("segment", ""))
        if ref.get("via") in ("tcp", "ucx"):
            owner = self.data_owners.get(name)
            return "" if owner == session.id else f"segment {name!r} does not belong to this session"
        if ref.get("via") == "shm":
            return "" if name.startswith("genie-c-") and "/" not in name else f"not a client segment: {name!r}"
        return f"unknown transfer kind {ref.get('via')!r}"

    def _on_data_probe(self, session: Session, msg: Message) -> None:
        """Discovery: receive a probe payload (inline, or by reading a client's shm segment)."""
        ref = msg.content.get("data")
        size = sum(len(b) for b in msg.buffers)
        if ref:
            problem = self._check_data_ref(session, ref)
            if problem:
                self._refuse(session, msg, "PermissionError", problem)
                return
            view = Segment.attach(ref["segment"]).view if ref.get("keep") else Segment.adopt(ref["segment"])
            size = sum(ref["sizes"])
            self._probe_scratch = getattr(self, "_probe_scratch", None) or bytearray(size)
            if len(self._probe_scratch) < size:
                self._probe_scratch = bytearray(size)
            memoryview(self._probe_scratch)[:size] = view[:size]  # read it all, as a worker would
            view.release()
        self._reply(session.identity, msg, "data_probe_reply", {"bytes": size})

    def _on_set_backend(self, session: Session, msg: Message) -> None:
        session.backend = str(msg.content.get("backend", ""))[:32]
        self._reply(session.identity, msg, "set_backend_reply", {"ok": True})


    def _to_worker(self, session: Session, msg: Message) -> None:
        slot, problem = self._slot_for(session, msg.content.get("gpu"))
        if problem:
            self._refuse(session, msg, "ValueError", problem)
            return
        worker = session.workers.get(slot)
        if worker is None:
            worker = session.workers[slot] = self._take_worker(slot)
            worker.session = session
        worker.inflight[msg.id] = msg
        if worker.ready:
            self._forward_to_worker(worker, msg)
        else:
            worker.waiting.append(msg)

    def _slot_for(self, session: Session, gpu: Any) -> tuple[int, str]:
        if gpu is None:
            return session.slot, ""
        try:
            index = int(gpu)
        except (TypeError, ValueError):
            return CPU, f"invalid GPU {gpu!r}: expected an index"
        if not self.gpus:
            if index == 0:
                return CPU, ""
            return CPU, f"GPU {index} does not exist: the server at {self.address} has no GPU (use --gpu 0, its CPU)"
        indices = [g["index"] for g in self.gpus]
        if index not in indices:
            return CPU, f"GPU {index} does not exist on {self.address}: it has GPUs {', '.join(map(str, indices))}"
        return index, ""

    def _forward_to_worker(self, worker: WorkerProcess, msg: Message) -> None:
        frames = self.worker_codec.pack(Message(msg.type, msg.content, msg.buffers, id=msg.id))
        self.worker_router.send_multipart([worker.id.encode(), *frames], copy=False)

    # -- workers --------------------------------------------------------------------------
    def _next_slot(self) -> int:
        if not self.gpus:
            return CPU
        load = {g["index"]: 0 for g in self.gpus}
        for s in self.sessions.values():
            if s.slot in load:
                load[s.slot] += 1
        return min(load, key=lambda i: (load[i], i))

    def _spawn(self, slot: int) -> WorkerProcess:
        worker = WorkerProcess(os.urandom(8).hex(), slot, self.worker_endpoint, self._lifeline.fd, self.limits)
        self.workers[worker.id] = worker
        return worker

    def _take_worker(self, slot: int) -> WorkerProcess:
        for w in self.spares:
            if w.slot == slot and w.alive():
                self.spares.remove(w)
                self._loop.call_soon(self._refill_spares)
                return w
        return self._spawn(slot)

    def _refill_spares(self) -> None:
        slot = self._next_slot()
        self.spares = [w for w in self.spares if w.alive()]
        if self.spare_workers > 0 and not any(w.slot == slot for w in self.spares):
            if len(self.spares) >= self.spare_workers:
                old = self.spares.pop(0)
                self.workers.pop(old.id, None)
                old.stop()
                self.dying.append(old)
            self.spares.append(self._spawn(slot))

    def _on_worker_readable(self, sock: zmq.Socket) -> None:
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            wid = frames[0].bytes.decode()
            worker = self.workers.get(wid)
            if worker is None:
                continue
            try:
                msg = self.worker_codec.unpack(frames[1:])
            except ProtocolError as exc:
                log.error("worker %s sent a malformed message: %s", wid, exc)
                continue
            kind = parse(msg.type, Peer.WORKER)
            if kind is None:
                log.error("refused a %r message from worker %s, which may not send it", msg.type, wid)
                continue
            if kind is T.READY:
                worker.ready = True
                for waiting in worker.waiting:
                    self._forward_to_worker(worker, waiting)
                worker.waiting.clear()
                continue
            request = worker.inflight.get(msg.parent)
            session = worker.session
            if request is None or session is None or session.id not in self.sessions:
                continue
            if kind in TERMINAL:
                worker.inflight.pop(msg.parent, None)
                session.finished(msg.parent, msg.content)
            self._send(session.identity, Message(msg.type, msg.content, msg.buffers, parent=msg.parent, session=session.id))

    def _housekeeping(self) -> None:
        for worker in list(self.workers.values()):
            if worker.alive():
                continue
            self.workers.pop(worker.id, None)
            sweep_worker(worker.pid)
            session = worker.session
            why = describe_exit(worker.proc.returncode, worker.pid)
            log.warning("worker %s (pid %d) %s", worker.id, worker.pid, why)
            if session is not None and session.workers.get(worker.slot) is worker:
                del session.workers[worker.slot]
                for request in list(worker.inflight.values()) + worker.waiting:
                    content = {
                        "ename": "WorkerDied",
                        "evalue": f"the session's worker process (pid {worker.pid}) {why} while running this request; "
                        "its variables are lost, and the next request starts a fresh worker",
                    }
                    session.finished(request.id, content)
                    self._reply(session.identity, request, "error_reply", content)
        still = []
        for w in self.dying:
            if w.reap():
                sweep_worker(w.pid)
            else:
                still.append(w)
        self.dying = still
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if now - session.last_seen > self.config.session_lease:
                self._close_session(session, f"no message from the client for {self.config.session_lease:.0f} s")

    def _on_parent_gone(self, fd: int) -> None:
        if parent_gone(fd):
            log.warning("the process that started this server is gone; stopping")
            self._loop.remove_socket(fd)
            self._loop.stop(join=False)

    def _close_session(self, session: Session, why: str) -> None:
        log.info("session %s closed: %s", session.id[:8], why)
        self.sessions.pop(session.id, None)
        session.ended(why)
        self.ended_sessions[session.id] = session  # its request record answers "did it run?" for a while
        while len(self.ended_sessions) > ENDED_REMEMBERED:
            self.ended_sessions.popitem(last=False)
        if session.client.get("purpose") != "probe":
            self.bus.emit(ClusterEvent(EventType.SESSION_CLOSED, self.node_id, Severity.INFO, {
                "session": session.id[:8], "client": session.client, "message": f"session {session.id[:8]} closed: {why}"}))
        for worker in session.workers.values():
            self.workers.pop(worker.id, None)
            worker.stop()
            self.dying.append(worker)
        session.workers.clear()


def run_server(config: ClusterConfig, parent_lifeline: int | None = None) -> int:
    """`genie serve`: start, print the ready line, serve until SIGINT/SIGTERM."""
    import signal

    server = Server(config, parent_lifeline=parent_lifeline).start()

    def _stop(signum: int, frame: Any) -> None:
        server._loop.stop(join=False)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(server.ready_line(), flush=True)
    if not is_loopback(config.ip) and not config.encrypt:
        print(
            f"WARNING: listening on {config.ip} WITHOUT ENCRYPTION: messages are signed, but code, outputs and data "
            "are readable by anyone on the network path. Use `genie serve --encrypt`, or 127.0.0.1 and an SSH tunnel.",
            file=sys.stderr, flush=True,
        )
    server.serve_forever()
    print("genie server stopped", flush=True)
    return 0
