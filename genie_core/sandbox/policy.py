"""What a sandbox should enforce (the admin's choice), and which of it this machine can enforce."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .cgroups import cgroup_support

if TYPE_CHECKING:
    from ..config import ClusterConfig

NETWORKS = ("none", "outbound", "host")
UID_BASE = 1_500_000_000  # the subordinate range sessions' uids come from (far above any login's)
UID_COUNT = 1 << 20


@dataclass(frozen=True)
class SandboxPolicy:
    network: str = "outbound"  # none: loopback only; outbound: not this host's or the cluster's services; host
    memory_bytes: int | None = None  # per session worker (and what its cells start), None: no limit
    processes: int | None = 4096  # threads included: a fork bomb stops here
    cpus: float | None = None  # CPU time, in CPUs' worth
    cluster_addresses: tuple[str, ...] = ()  # other machines whose services cells may not reach (the pool's nodes)
    uid_base: int = UID_BASE
    uid_count: int = UID_COUNT

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise ValueError(f"unknown session network {self.network!r}: choose one of {', '.join(NETWORKS)}")


@dataclass(frozen=True)
class Protection:
    name: str
    on: bool
    detail: str  # what it does when on; why it is off otherwise

    def line(self) -> str:
        return f"{'on ' if self.on else 'OFF'} {self.name}: {self.detail}"


def _bwrap_works() -> tuple[bool, str]:
    path = shutil.which("bwrap")
    if path is None:
        return False, "bubblewrap is not installed (Debian: apt-get install bubblewrap)"
    probe_cmd = [path, "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/", "--proc", "/proc", "true"]
    try:
        done = subprocess.run(probe_cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bubblewrap did not run: {exc}"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return False, f"bubblewrap cannot make namespaces here ({why}): user namespaces are off?"
    return True, path


def _nft_works() -> bool:
    if os.geteuid() != 0 or shutil.which("nft") is None:
        return False
    try:
        return subprocess.run(["nft", "list", "tables"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def probe(policy: SandboxPolicy) -> list[Protection]:
    """Each protection the policy asks for, on or off on this machine (and why)."""
    ns_ok, ns_detail = _bwrap_works()
    root = os.geteuid() == 0
    out = [
        Protection(
            "processes and files",
            ns_ok,
            "own PID, mount, IPC and UTS namespaces (and a user namespace when the server is not root); "
            "read-only root; private /tmp and /dev/shm; no capabilities"
            if ns_ok
            else ns_detail,
        ),
        Protection(
            "own uid",
            ns_ok and root,
            f"each session runs as a uid of its own from {policy.uid_base}"
            if root
            else "the server is not root: cells run as its user (in their own user namespace)",
        ),
        Protection("GPUs", ns_ok, "only the session's GPU device nodes in its /dev" if ns_ok else ns_detail),
    ]
    if policy.network == "none":
        out.append(Protection("network", ns_ok, "none: loopback only" if ns_ok else ns_detail))
    elif policy.network == "outbound":
        nft = _nft_works()
        out.append(
            Protection(
                "network",
                nft and ns_ok and root,
                "outbound: no route to this host's or the cluster's services"
                if nft and root
                else "outbound needs root and nftables (nft) to keep cells from this host's services",
            )
        )
    else:
        out.append(Protection("network", True, "host, the admin's choice: cells reach whatever this host reaches"))
    cg_ok, cg_detail = cgroup_support() if root else (False, "cgroups need the server to run as root")
    out.append(Protection("limits", cg_ok and ns_ok, cg_detail))
    return out


def policy_of(config: ClusterConfig) -> SandboxPolicy:
    """The sandbox a server's settings ask for."""
    blocked = tuple(a.strip() for a in (config.session_blocked or "").split(",") if a.strip())
    return SandboxPolicy(
        network=config.session_network,
        memory_bytes=config.session_memory_bytes,
        processes=config.session_processes,
        cpus=config.session_cpus,
        cluster_addresses=blocked,
    )


def require(protections: list[Protection], allow_unisolated: bool) -> None:
    """ConfigError naming each protection that is off, unless the admin allowed running without."""
    missing = [p for p in protections if not p.on]
    if missing and not allow_unisolated:
        raise ConfigError(
            "the sandbox cannot give every protection here; start with --allow-unisolated to run without "
            "them, or fix: " + "; ".join(f"{p.name}: {p.detail}" for p in missing)
        )


def refuse_unisolated(settings: dict[str, Any]) -> list[Protection]:
    """For a pool, at its start: the protections its sessions' sandbox would have on this machine,
    or ConfigError if one is off and `allow_unisolated` is not set."""
    from ..config import ClusterConfig

    config = ClusterConfig.resolve(**settings)
    if not config.sandbox:
        return []
    protections = probe(policy_of(config))
    require(protections, config.allow_unisolated)
    return protections
