"""The process-wide connection: `init`, `shutdown` (and their `_sync` twins), `is_initialized`,
`get_cluster_state`."""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from .client import Client, ConnectOptions
from .client.pool import PoolClient, is_pool_token
from .config import DEFAULT_PORT, ClusterConfig, ConnectionInfo, parse_address
from .errors import ConfigError, NotInitializedError, add_note
from .events import EventBus
from .local_server import LocalServer
from .monitoring.health import HealthReport
from .nodes import NodeInfo
from .protocol.contents import NodeDescription

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("genie")

_lock = threading.RLock()
_state: ClusterState | None = None


@dataclass
class ClusterState:
    """What this process is connected to (or serving), and how it got there."""

    config: ClusterConfig
    role: str
    address: str
    node: NodeDescription = field(default_factory=NodeDescription)  # the server's, as its welcome says
    backend: str = "zmq"
    backend_report: Any = None  # dataplane.BackendReport: candidates, measurements, choice
    phases: list[tuple[str, float]] = field(default_factory=list)
    client: Client | None = None
    server: Any = None
    local_server: LocalServer | None = None
    pool: Any = None  # client.pool.PoolClient, when a pool placed this session
    placement: dict[str, Any] | None = None  # where the pool placed it: node, GPUs, how many were free
    started: float = field(default_factory=time.time)

    @property
    def connected(self) -> bool:
        if self.role == "server":
            return self.server is not None
        return self.client is not None and self.client.connected

    @property
    def embedded(self) -> bool:
        return self.local_server is not None

    @property
    def events(self) -> EventBus:
        """Where cluster events arrive (widgets subscribe here)."""
        return self.client.events if self.client is not None else self.server.bus

    @property
    def metrics(self) -> NodeInfo | None:
        """The newest readings of the node (pushed by the server about once a second)."""
        if self.client is not None:
            return self.client.metrics
        return self.server.monitor.latest if self.server.monitor else None

    @property
    def health(self) -> HealthReport | None:
        if self.client is not None:
            return self.client.health
        return self.server.monitor.health_report if self.server.monitor else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "address": self.address,
            "connected": self.connected,
            "embedded": self.embedded,
            "backend": self.backend,
            "backend_report": self.backend_report.to_dict() if self.backend_report else None,
            "node": self.node,
            "session": self.client.session[:8] if self.client else None,
            "lost_reason": self.client.lost_reason if self.client else None,
            "health": self.health.to_dict() if self.health else None,
            "phases": [{"name": n, "seconds": round(s, 4)} for n, s in self.phases],
        }


def _setup_logging(level: str) -> None:
    logger = logging.getLogger("genie")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[genie %(levelname)s] %(message)s"))
        logger.addHandler(handler)


def init_sync(
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    node_id: str | None = None,
    node_role: str | None = None,
    timeout: float | None = None,
    *,
    connection_file: str | Path | None = None,
    on_phase: Callable[[str, float], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
    **settings: Any,
) -> ClusterState:
    """Connect to a genie server (or, with no address, start an embedded one) and return the state.
    `connection_file`: a server's (address, token, keys); `on_phase(name, seconds)` is called as
    each phase completes (the init widget shows them); `on_wait(text)` as a pool's queue moves,
    while this waits for GPUs; `settings`: any other `ClusterConfig` field (token, session_name,
    pool_gpus, ...), of which a misspelt one is a TypeError naming the closest.

    `master_port` defaults to 5555; every argument left out falls back to its `GENIE_*`
    environment variable. `node_role="server"` serves from this process instead.
    Calling it again replaces the previous connection once the new one is up; when the new one
    fails (or is cancelled), the previous one stays current and the error says so.
    """
    phases: list[tuple[str, float]] = _Phases(on_phase)
    t0 = time.perf_counter()
    earlier = _state
    try:
        config = ClusterConfig.resolve(
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            node_id=node_id,
            node_role=node_role,
            timeout=timeout,
            connection_file=connection_file,
            **settings,
        )
        _setup_logging(config.log_level)
        phases.append(("configure", time.perf_counter() - t0))
        if config.node_role == "server":
            if earlier is not None and earlier.role == "server":
                _close(end_named=False)  # this process's server, replaced: its port is to be bound again
            state = _init_server(config, phases, t0)
        else:
            state = _init_client(config, phases, on_wait)
    except BaseException as exc:
        _say_unchanged(exc, earlier)
        raise
    _replace(state)
    return state


def _replace(state: ClusterState) -> None:
    """Make `state` current, then close the one it replaces (a named session of that one is left
    running, for a later init to attach to)."""
    global _state
    with _lock:
        earlier, _state = _state, state
    if earlier is not None:
        _close_state(earlier, end_named=False)


def _say_unchanged(exc: BaseException, earlier: ClusterState | None) -> None:
    """A failed or cancelled init leaves the earlier connection current: the error says so."""
    if earlier is None or earlier is not _state or not earlier.connected:
        return
    session = f", session {earlier.client.session[:8]}" if earlier.client is not None else ""
    note = f"nothing changed: still connected to genie://{earlier.address}{session}, its variables intact"
    if isinstance(exc, KeyboardInterrupt):
        print(f"genie: init cancelled; {note}", file=sys.stderr)
    else:
        add_note(exc, note)


class _Phases(list[tuple[str, float]]):
    """The list of (phase, seconds); `on_phase(name, seconds)` hears of each as it completes."""

    def __init__(self, on_phase: Callable[[str, float], None] | None = None) -> None:
        super().__init__()
        self.on_phase = on_phase

    def append(self, item: tuple[str, float]) -> None:
        super().append(item)
        if self.on_phase is not None:
            self.on_phase(*item)


def _init_server(config: ClusterConfig, phases: list[tuple[str, float]], t0: float) -> ClusterState:
    from .server import Server

    server = Server(config).start().start_in_thread()
    phases.append(("serve", time.perf_counter() - t0))
    return ClusterState(
        config=config, role="server", address=server.address, node=server.node_info(), server=server, phases=phases
    )


def _init_client(
    config: ClusterConfig, phases: list[tuple[str, float]], on_wait: Callable[[str], None] | None = None
) -> ClusterState:
    t = time.perf_counter()
    local: LocalServer | None = None
    if config.master_addr in (None, "", "local") and not config.connection_file:
        local = LocalServer(config.gpus)
        info = local.start(config.timeout)
        host, port, token, curve = info.ip, info.port, info.token, info.curve
        phases.append(("local server", time.perf_counter() - t))
    else:
        host, port, token, curve = resolve_server(config)
    pool = None
    if is_pool_token(token):  # a pool: ask it for a session, then connect to that session's server
        pool = PoolClient(host, port, token, timeout=config.timeout)
        try:
            placed = pool.place(
                config.pool_gpus, config.session_name or "", config.pool_wait, on_wait, config.pool_accelerator or ""
            )
        except BaseException:
            pool.close()
            raise
        host, port, token, curve = str(placed["host"]), int(placed["port"]), str(placed["token"]), None
        phases.append((f"placed on {placed['node']}", time.perf_counter() - t))
    t = time.perf_counter()
    client = Client(host, port, token, options=ConnectOptions.of(config, curve))
    if pool is not None:
        pooled(client.connection, str(placed["node"]))
    try:
        client.connect()
        phases.append(("connect", time.perf_counter() - t))
        t = time.perf_counter()
        report = client.select_backend(config.backend, config.discovery_budget)
        phases.append(("discovery", time.perf_counter() - t))
        if config.sync:
            t = time.perf_counter()
            client.sync(config.sync)
            phases.append(("sync", time.perf_counter() - t))
    except BaseException:
        # A no-op when the connect itself failed; a named session this client attached to keeps running.
        client.close(notify=client.connected and not client.attached)
        if local is not None:
            local.stop()
        if pool is not None:
            pool.cancel()  # placed, but not usable from here: its GPUs go back to the pool
            pool.close()
        raise
    if pool is not None:
        pool.watch(lambda reason: _session_lost(client, reason))
    from .remote_tensor import enable

    enable(
        lambda: _state.client if _state is not None else None
    )  # remote_accelerator tensors, served by this connection
    return ClusterState(
        config=config,
        role="client",
        address=f"{host}:{port}",
        node=client.node,
        client=client,
        local_server=local,
        phases=phases,
        backend=report.chosen,
        backend_report=report,
        pool=pool,
        placement=placed if pool is not None else None,
    )


def pooled(connection: Any, node: str) -> None:
    """A pool's session: a lost connection names its node, and the one thing to do is to be placed again."""
    connection.pooled = True
    connection.serving = f"your session on {node} ({connection.address})"
    connection.when_gone = "run %genie_init again to be placed on another node"


def _session_lost(client: Client, reason: str) -> None:
    """The pool says this client's session is gone (its node left): fail what waits, and say so
    once. The connection says it: one NODE_LOST for the loss, whichever is heard first, the pool's
    notice or the connection closing (it adds the one thing to do)."""
    client.connection.session_lost(f"session lost: {reason}")


def resolve_server(config: ClusterConfig) -> tuple[str, int, str, dict[str, str] | None]:
    """(host, port, token, encryption keys) of a server named by address (or only by its connection
    file), with the token from the argument or `GENIE_TOKEN`, then the connection file, then a
    local server's one. The keys of a server started with --encrypt come from its connection file."""
    if config.connection_file and not config.master_addr:
        info = ConnectionInfo.read(config.connection_file)
        return info.ip, info.port, config.token or info.token, info.curve
    host, port = parse_address(config.master_addr or "", config.master_port or DEFAULT_PORT)
    assert port is not None
    known = ConnectionInfo.read(config.connection_file) if config.connection_file else ConnectionInfo.find(host, port)
    token = config.token or (known.token if known else None)
    if token is None:
        raise ConfigError(
            f"no token for {host}:{port}: pass --token (or token=...), set GENIE_TOKEN, or pass the server's "
            "connection file (printed by `genie serve`)"
        )
    return host, port, token, known.curve if known else None


def _awaitable(sync: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """`sync` run on a worker thread, so the event loop keeps running; the same parameters."""

    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(sync, *args, **kwargs)

    run.__wrapped__ = sync  # type: ignore[attr-defined]  # help() and `init?` show its parameters
    return run


init = _awaitable(init_sync)
init.__name__ = init.__qualname__ = "init"
init.__doc__ = (
    "Awaitable `init_sync` (the same parameters): connects on a worker thread, so the event loop keeps running."
)


async def shutdown() -> None:
    """Awaitable `shutdown_sync`: closes on a worker thread, so the event loop keeps running."""
    await asyncio.to_thread(shutdown_sync)


def shutdown_sync() -> None:
    """Close the session (its worker ends, its GPU memory is freed) and any embedded server."""
    _close(end_named=True)


def _close(end_named: bool) -> None:
    """Close the connection; a named session is ended only when `end_named`, else left running
    for a later `init(..., session_name=NAME)` to attach to (as when the process exits)."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        _close_state(state, end_named)


def _close_state(state: ClusterState, end_named: bool) -> None:
    if state.client is not None:
        state.client.close(notify=end_named or not state.client.session_name)
    if state.server is not None:
        state.server.stop()
    if state.local_server is not None:
        state.local_server.stop()
    if state.pool is not None:
        state.pool.close()


def is_initialized() -> bool:
    return _state is not None


def get_cluster_state() -> ClusterState:
    if _state is None:
        raise NotInitializedError("asking for the cluster state")
    return _state


def current_client(what: str = "running remote code") -> Client:
    """The connected client, or a clear error saying what to run."""
    state = _state
    if state is None or state.client is None:
        raise NotInitializedError(what)
    return state.client


atexit.register(_close, end_named=False)  # a named session survives a kernel restart
