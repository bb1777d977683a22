"""How a client connects and keeps its connection: one set of options, given to `Client` (as
keywords), to `Connection`, and made from a `ClusterConfig` by `init`."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ClusterConfig


@dataclass(frozen=True)
class ConnectOptions:
    timeout: float = 30.0  # seconds for the handshake, and a request's default wait
    enable_heartbeat: bool = True
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 4.0  # seconds of silence before the connection counts as lost
    purpose: str = "session"  # "probe" for one-shot tools like `genie status`
    curve: dict[str, str] | None = None  # keys from the connection file of a server started with --encrypt
    session_name: str = ""  # a named session outlives its client; a hello naming it attaches
    data_port: int | None = None  # a tcp data port given by the user (tunnels, relays), else the server's

    @classmethod
    def of(cls, config: ClusterConfig, curve: dict[str, str] | None = None) -> ConnectOptions:
        """The options a configuration asks for (`curve`: the server's keys, when it encrypts)."""
        return cls(
            timeout=config.timeout,
            enable_heartbeat=config.enable_heartbeat,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout,
            curve=curve,
            session_name=config.session_name or "",
            data_port=config.data_port,
        )
