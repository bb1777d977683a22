"""The genie server (node agent): one port for clients, a private socket for its workers, and the
parts that do the work: admission (who gets in), sessions, the workers, telemetry, the data
plane, the client requests (requests.py) and the sessions' upkeep (upkeep.py). This module makes
and binds them and passes messages between them; it never runs user code."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
from ..dataplane.filling import Fillings
from ..dataplane.stream import DataHost
from ..errors import ConfigError
from ..gpus import list_gpus
from ..lifeline import parent_gone
from ..loop import SocketLoop
from ..monitoring import GPUSource
from ..nodes import GPUInfo
from ..protocol import PROTOCOL_VERSION, Codec, Message, MessageType, derive_key
from ..protocol.contents import Limits, NodeDescription
from ..sandbox import Sandbox, policy_of, require
from .admission import Admission
from .data import DataPlane
from .requests import ClientRequests
from .sessions import Session, SessionTable
from .telemetry import Telemetry
from .upkeep import Upkeep
from .workers import WorkerPool, sweep_orphans

log = logging.getLogger("genie.server")


class Server:
    """`Server(config).start()` binds and returns; `serve_forever()` or `start_in_thread()` runs it.
    Its parts are made here; `start` binds their sockets and starts their threads."""

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
        self.limits = Limits(
            session_tensors=self.config.max_session_tensors,
            session_bytes=self.config.max_session_bytes,
            message_bytes=self.config.max_message_bytes,
        )
        self.node_id = self.config.resolved_node_id()
        self.signing_key = derive_key(self.token)  # also the data plane's
        self.codec = Codec(self.signing_key, max_bytes=self.config.max_message_bytes)
        self.parent_lifeline = parent_lifeline  # a pipe from whoever embeds us: we stop when it closes
        detected, gpu_reason = list_gpus()
        if self.config.gpus is not None:
            by_index = {g.index: g for g in detected}
            self.gpus = [by_index.get(i, GPUInfo(i, name="unknown")) for i in self.config.gpus]
        else:
            self.gpus = detected
        self.port = 0
        self.connection_file: Path | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._loop = SocketLoop("server")
        self._thread: threading.Thread | None = None
        self._seq = 0
        self.sandbox_report = ""  # which protections the sandbox gives here (config.sandbox)
        self.sandbox = self._make_sandbox()
        self.sessions = SessionTable()
        fillings = Fillings()  # segments a worker fills while a data port sends them
        self.workers = WorkerPool(
            limits=self.limits,
            gpus=self.gpus,
            spares=self.config.spare_workers if spare_workers is None else spare_workers,
            reply=self._from_worker,
            sessions=self.sessions.live,
            sandbox=self.sandbox,
            max_message_bytes=self.config.max_message_bytes,
            fillings=fillings,
        )
        self.telemetry = Telemetry(
            self.config, self.node_id, self.gpus, gpu_reason, gpu_source, owners=lambda: self.upkeep.process_owners()
        )
        self.upkeep = Upkeep(
            config=self.config, node_id=self.node_id, sessions=self.sessions, workers=self.workers, bus=self.bus
        )
        max_put = min(self.config.max_session_bytes or self.config.max_message_bytes, self.config.max_message_bytes)
        self.data = DataPlane(
            ServerSide(
                self.config.ip,
                0,  # the control port, once bound
                fixed_port=bool(self.config.master_port),
                data_port=self.config.data_port,
                host=DataHost(self.signing_key, self.workers.worker_pids, max_put=max_put, fillings=fillings),
                encrypted=self.config.encrypt,
                enable_ucx=self.config.enable_ucx,
            )
        )
        self.requests = ClientRequests(
            sessions=self.sessions,
            workers=self.workers,
            data=self.data,
            telemetry=self.telemetry,
            upkeep=self.upkeep,
            reply=self._reply,
            call_soon=self._loop.call_soon,
            node_info=self.node_info,
            address=lambda: self.address,
        )
        self.admission = Admission(
            codec=self.codec,
            sessions=self.sessions.live,
            ended=self.sessions.ended,
            call_soon=self._loop.call_soon,
            admit=self.requests.on_admitted,
            reply=self._reply,
            send_raw=self._send_raw,
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
        ctx = self._ctx = zmq.Context()
        self.router = self._bind_clients(ctx)
        worker_sock = self.workers.listen(ctx, self.address)
        if self.sandbox is not None:
            self.sandbox.start()
        self._loop.add_receiver(self.router, self.admission.on_frames)
        self._loop.add_receiver(worker_sock, self.workers.on_message, batch=256)
        if self.parent_lifeline is not None:
            self._loop.add_socket(self.parent_lifeline, self._on_parent_gone)
        sweep_orphans()
        self._loop.call_every(0.2, self.upkeep.tick)
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
            assert self.workers.folder is not None
            empty = self.workers.folder / "empty"
            empty.touch(mode=0o444)
            self.sandbox.mask(self.connection_file, empty)
        self.telemetry.start(self.address, self._broadcast)
        self.data.start(self.port)
        self.workers.refill_spares()
        return self

    def _bind_clients(self, ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
        """The clients' ROUTER socket on the configured address (port 0: any free one), or ConfigError."""
        router: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its routing id
        router.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        if ":" in self.config.ip:
            router.setsockopt(zmq.IPV6, 1)
        if self.config.encrypt:
            from ..encryption import KeyGate, Keys, secure_server

            self.keys = Keys()
            self.gate = KeyGate(ctx, {self.keys.client_public})
            secure_server(router, self.keys)
        host = f"[{self.config.ip}]" if ":" in self.config.ip else self.config.ip
        try:
            if self.config.master_port == 0:
                self.port = router.bind_to_random_port(f"tcp://{host}")
            else:
                router.bind(f"tcp://{host}:{self.config.master_port}")
                self.port = self.config.master_port
        except zmq.ZMQError as exc:
            router.close()
            if self.gate is not None:
                self.gate.stop()
            ctx.term()
            raise ConfigError(f"cannot listen on {self.config.ip}:{self.config.master_port}: {exc.strerror}") from None
        return router

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

    def node_info(self) -> NodeDescription:
        return self.telemetry.node_info(self.address, self.data.info, self.limits)

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
        """On the loop thread, as it ends (the loop then closes the sockets and ends the context).
        Workers first: they hold the GPUs' memory, and nothing below may keep them waiting."""
        self.workers.stop_all()
        self.data.stop()
        if self.gate is not None:
            self.gate.stop()
        self.admission.close()
        self.telemetry.stop()
        if self.sandbox is not None:
            self.sandbox.stop()
        self.router.close()
        if self.workers.sock is not None:
            self.workers.sock.close()
        if self._ctx is not None:
            self._ctx.term()
        if self.connection_file is not None:
            self.connection_file.unlink(missing_ok=True)
        self.workers.remove_folders()

    def _on_parent_gone(self, fd: int) -> None:
        if parent_gone(fd):
            log.warning("the process that started this server is gone; stopping")
            self._loop.remove_socket(fd)
            self._loop.stop(join=False)

    # -- sending --------------------------------------------------------------------------
    def _send(self, identity: bytes, msg: Message) -> None:
        self._seq += 1
        msg.seq = self._seq
        self.router.send_multipart([identity, *self.codec.pack(msg)], copy=False)

    def _reply(
        self,
        identity: bytes,
        request: Message,
        kind: str,
        content: Mapping[str, Any],
        buffers: list[Any] | None = None,
    ) -> None:
        self._send(identity, Message(kind, content, buffers or [], parent=request.id, session=request.session))

    def _send_raw(self, identity: bytes, frames: list[Any]) -> None:
        self.router.send_multipart([identity, *frames])

    def _broadcast(self, kind: MessageType, content: Mapping[str, Any]) -> None:
        """Events and readings to every session's heartbeat connection (from any thread)."""

        def send() -> None:
            for session in list(self.sessions.live.values()):
                self._send(session.event_identity, Message(kind, content, session=session.id))

        self._loop.call_soon(send)

    def _from_worker(self, session: Session, msg: Message) -> None:
        session.jobs.record(msg)
        self._send(session.identity, Message(msg.type, msg.content, msg.buffers, parent=msg.parent, session=session.id))


def run_server(config: ClusterConfig, parent_lifeline: int | None = None) -> int:
    """`genie serve`: start, print the ready line, serve until SIGINT/SIGTERM."""
    import signal

    from .allocator import map_large_blocks

    map_large_blocks()  # only in a server process of its own: it changes malloc for the whole process
    server = Server(config, parent_lifeline=parent_lifeline).start()

    def _stop(signum: int, frame: Any) -> None:
        server.stop(timeout=0)

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
