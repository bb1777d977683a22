"""Configuration: one dataclass, filled from explicit arguments, then `GENIE_*` variables, then defaults."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import secrets
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

DEFAULT_PORT = 5555
BACKENDS = ("auto", "shm", "tcp", "zmq", "ucx", "rdma", "dpdk", "gpudirect")
ROLES = ("client", "server")


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """`"8GiB"`, `"512M"`, `"1000"` -> bytes (units are powers of 1024)."""
    if isinstance(text, int):
        return text
    low = text.strip().lower().removesuffix("ib").removesuffix("b")
    number, unit = (low[:-1], low[-1]) if low and low[-1] in _UNITS else (low, "")
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise ConfigError(f"invalid size {text!r}: expected bytes like 8GiB, 512MiB or 1000000") from None


def parse_gpus(text: str | list[int] | None) -> list[int] | None:
    """`"0,1"` -> `[0, 1]`; an empty string means "no GPUs"."""
    if text is None or isinstance(text, list):
        return text
    text = text.strip()
    if not text:
        return []
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"invalid GPU list {text!r}: expected indices like 0,1") from None


@dataclass
class ClusterConfig:
    """Everything `init` and `genie serve` need. Each field has a `GENIE_<NAME>` variable."""

    master_addr: str | None = None
    master_port: int = DEFAULT_PORT
    token: str | None = None
    backend: str = "auto"
    node_id: str | None = None
    node_role: str = "client"
    timeout: float = 30.0
    ip: str = "127.0.0.1"
    gpus: list[int] | None = None
    connection_file: str | None = None
    enable_heartbeat: bool = True
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 4.0
    session_lease: float = 30.0
    sync: str | None = None  # client: a directory to %genie_sync at connect (its code, on the server's sys.path)
    pool_gpus: int = 1  # client: GPUs to ask a pool for (a pool token, user:secret, says the address is a pool)
    pool_wait: float = 600.0  # client: seconds to wait in a full pool's queue before giving up
    pool_accelerator: str | None = None  # client: the GPU type to ask a pool for (as its nodes declare to Ray)
    session_name: str | None = None  # client: a named session outlives this process; the same name attaches to it
    idle_timeout: float = 0.0  # server: end sessions with no client and no cell running for this long (0: never)
    enable_gpu_monitoring: bool = True
    gpu_poll_interval: float = 1.0
    enable_health_checks: bool = True
    health_check_interval: float = 5.0
    simulate_gpus: int = 0  # a labelled fake GPU source, for demos and tests without a GPU
    state_dir: str | None = None
    # server: where the tcp data plane listens (default: control port + 1);
    # client: where to reach it, when a tunnel or relay moves it (default: as the server says)
    data_port: int | None = None
    discovery_budget: float = 0.3  # seconds that backend discovery may spend measuring
    max_message_bytes: int = 8 << 30
    enable_ucx: bool = True  # server: offer the ucx data plane (importing ucxx costs about a second of CPU at start)
    encrypt: bool = False  # server: CurveZMQ on the control connection (keys in the connection file)
    max_session_tensors: int = 1_000_000  # server: remote tensors one session may hold
    max_session_bytes: int | None = None  # server: bytes of remote tensors one session may hold (and the largest push)
    spare_workers: int = 1  # server: workers started ahead of need, so a new session's first cell does not wait
    sandbox: bool = False  # server: each session's worker in a sandbox of its own (see genie_core.sandbox)
    session_network: str = "outbound"  # server, sandboxed: none, outbound (not this host's services) or host
    session_memory_bytes: int | None = None  # server, sandboxed: memory one session's worker may use
    session_processes: int | None = 4096  # server, sandboxed: processes and threads one session may run
    session_cpus: float | None = None  # server, sandboxed: CPU time one session may use, in CPUs
    allow_unisolated: bool = False  # server: start even where the sandbox lacks a protection (said at start)
    sandbox_hide: str | None = None  # server, sandboxed: more folders cells may not see, comma-separated
    session_blocked: str | None = None  # server, sandboxed (outbound): addresses cells may not reach, comma-separated
    log_level: str = "WARNING"

    @classmethod
    def resolve(cls, environ: dict[str, str] | None = None, **explicit: Any) -> ClusterConfig:
        """Explicit (non-None) arguments win, then `GENIE_*` variables, then defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        names = {f.name: f for f in dataclasses.fields(cls)}
        for key in explicit:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                raise TypeError(
                    f"unknown setting {key!r}"
                    + (f": did you mean {near[0]!r}?" if near else f"; the settings are {', '.join(names)}")
                )
        for name, f in names.items():
            value = explicit.get(name)
            if value is None:
                raw = env.get(f"GENIE_{name.upper()}")
                if raw is not None and raw != "":
                    value = _from_env(name, f.type, raw)
            if value is not None:
                values[name] = value
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            raise ConfigError(f"invalid port {self.master_port!r}: expected 0..65535")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.node_role not in ROLES:
            raise ConfigError(f"unknown node_role {self.node_role!r}: choose one of {', '.join(ROLES)}")
        if self.timeout <= 0:
            raise ConfigError(f"invalid timeout {self.timeout!r}: must be positive")
        if self.heartbeat_interval <= 0 or self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(
                f"invalid heartbeat settings: need 0 < heartbeat_interval ({self.heartbeat_interval})"
                f" < heartbeat_timeout ({self.heartbeat_timeout})"
            )
        if self.gpu_poll_interval < 0.1:
            raise ConfigError(
                f"invalid gpu_poll_interval {self.gpu_poll_interval}: "
                "at least 0.1 s (NVML calls serialize in the driver)"
            )
        if self.spare_workers < 0:
            raise ConfigError(f"invalid spare_workers {self.spare_workers}: 0 or more")
        if self.max_session_tensors < 1:
            raise ConfigError(f"invalid max_session_tensors {self.max_session_tensors}: at least 1")
        if isinstance(self.max_session_bytes, str):
            self.max_session_bytes = parse_size(self.max_session_bytes)
        if self.max_session_bytes is not None and self.max_session_bytes < 1:
            raise ConfigError(f"invalid max_session_bytes {self.max_session_bytes}: at least 1 byte")
        if isinstance(self.session_memory_bytes, str):
            self.session_memory_bytes = parse_size(self.session_memory_bytes)
        if self.session_network not in ("none", "outbound", "host"):
            raise ConfigError(f"unknown session network {self.session_network!r}: choose none, outbound or host")
        if self.health_check_interval <= 0:
            raise ConfigError(f"invalid health_check_interval {self.health_check_interval}: must be positive")
        self.gpus = parse_gpus(self.gpus)

    def resolved_node_id(self) -> str:
        return self.node_id or socket.gethostname()


def _from_env(name: str, type_name: Any, raw: str) -> Any:
    type_text = str(type_name)
    try:
        if name == "gpus":
            return parse_gpus(raw)
        if name.endswith("_bytes"):
            return parse_size(raw)
        if type_text.startswith("bool"):
            return _parse_bool(raw)
        if type_text.startswith("int"):
            return int(raw)
        if type_text.startswith("float"):
            return float(raw)
    except ValueError as exc:
        raise ConfigError(f"invalid GENIE_{name.upper()}={raw!r}: {exc}") from None
    return raw


def parse_address(text: str, default_port: int | None = None) -> tuple[str, int | None]:
    """`host`, `host:port`, `genie://host:port`, `[::1]:port` -> (host, port or default)."""
    addr = text.strip()
    if addr.startswith("genie://"):
        addr = addr[len("genie://") :]
    elif "://" in addr:
        raise ConfigError(f"invalid address {text!r}: only genie://host:port is understood")
    addr = addr.rstrip("/")
    if not addr:
        raise ConfigError(f"invalid address {text!r}: no host")
    port_text = None
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        if rest.startswith(":"):
            port_text = rest[1:]
    elif addr.count(":") == 1:
        host, port_text = addr.split(":")
    else:
        host = addr
    if port_text is None or port_text == "":
        return host, default_port
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"invalid port in {text!r}: {port_text!r} is not a number") from None
    if not 0 < port <= 65535:
        raise ConfigError(f"invalid port in {text!r}: expected 1..65535")
    return host, port


def runtime_dir_for(environ: Mapping[str, str]) -> Path:
    """The runtime folder that a process with this environment uses."""
    if environ.get("GENIE_RUNTIME_DIR"):
        return Path(environ["GENIE_RUNTIME_DIR"])
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "genie"
    return Path(environ.get("HOME") or Path.home()) / ".local" / "share" / "genie" / "runtime"


def runtime_dir() -> Path:
    """Private folder (mode 0700) for connection files and server logs."""
    path = runtime_dir_for(os.environ)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def state_dir(node_id: str, configured: str | None = None) -> Path:
    """Where a server keeps what survives a restart (metric history, events)."""
    base = Path(configured or os.environ.get("GENIE_STATE_DIR") or Path.home() / ".local" / "state" / "genie")
    path = base / node_id
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def new_token() -> str:
    return secrets.token_urlsafe(32)


MIN_NETWORK_TOKEN = 16  # characters a token needs before a server listens beyond loopback


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, with or without an IPv6 zone, or a name) is this machine's loopback."""
    import ipaddress

    address = host.split("%")[0]
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


@dataclass
class ConnectionInfo:
    """What a client needs to reach a server; written by `genie serve` as JSON, mode 0600."""

    ip: str
    port: int
    token: str
    node_id: str
    pid: int
    protocol: int
    curve: dict[str, str] | None = None  # a server started with --encrypt: its public key and a client key pair

    def write(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".genie-", suffix=".json")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump({k: v for k, v in dataclasses.asdict(self).items() if v is not None}, fh, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ConnectionInfo:
        try:
            data = json.loads(Path(path).read_text())
            return cls(
                **{
                    f.name: data[f.name]
                    for f in dataclasses.fields(cls)
                    if f.name in data or f.default is dataclasses.MISSING
                }
            )
        except FileNotFoundError:
            raise ConfigError(f"connection file {str(path)!r} does not exist") from None
        except PermissionError:
            raise ConfigError(f"connection file {str(path)!r} is not readable (permission denied)") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"connection file {str(path)!r} is not a Genie connection file ({exc})") from None

    @classmethod
    def all_local(cls) -> list[tuple[Path, ConnectionInfo]]:
        """Connection files of servers on this machine whose process is still running."""
        found = []
        for path in sorted(runtime_dir().glob("genie-*.json"), key=lambda p: p.stat().st_mtime):
            try:
                info = cls.read(path)
                os.kill(info.pid, 0)
            except (ConfigError, ProcessLookupError):
                continue
            except PermissionError:
                pass
            found.append((path, info))
        return found

    @classmethod
    def find(cls, host: str, port: int) -> ConnectionInfo | None:
        """A connection file in this machine's runtime folder for a local server at host:port."""
        local = {"127.0.0.1", "localhost", "::1", socket.gethostname()}
        for path in sorted(runtime_dir().glob("genie-server-*.json")):
            try:
                info = cls.read(path)
            except ConfigError:
                continue
            if info.port == port and (info.ip == host or (host in local and info.ip in local | {"0.0.0.0"})):
                return info
        return None
