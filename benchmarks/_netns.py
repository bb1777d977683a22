"""Two network namespaces joined by a veth pair: a real "other host" on one machine, for the tests
and benchmarks that need one (root and `ip netns`; nothing outside the pair is touched)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator

SERVER_IP, CLIENT_IP = "10.231.77.1", "10.231.77.2"  # inside the namespaces made here, nowhere else


class Unavailable(RuntimeError):
    """This machine cannot make the pair (not root, no `ip netns`, a step refused): why."""


def sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def host_pair(rate_mbit: int | None = None) -> Iterator[tuple[str, str]]:
    """Yield (server namespace, client namespace) joined by a veth pair, SERVER_IP on one end and
    CLIENT_IP on the other, each end's interface named after its namespace (GLOO_SOCKET_IFNAME and
    the like can name it); `rate_mbit` limits each direction with tc tbf (None: the veth's own
    speed, which on one machine is the CPU's). Both are deleted on the way out."""
    tag = os.urandom(2).hex()
    srv, cli = f"genie-s{tag}", f"genie-c{tag}"
    if os.geteuid() != 0 or shutil.which("ip") is None or sh("ip", "netns", "add", srv).returncode != 0:
        raise Unavailable("cannot create network namespaces here (needs root and `ip netns`)")
    try:
        steps = [
            ("ip", "netns", "add", cli),
            ("ip", "link", "add", srv, "type", "veth", "peer", "name", cli),
            ("ip", "link", "set", srv, "netns", srv),
            ("ip", "link", "set", cli, "netns", cli),
            ("ip", "-n", srv, "addr", "add", f"{SERVER_IP}/24", "dev", srv),
            ("ip", "-n", cli, "addr", "add", f"{CLIENT_IP}/24", "dev", cli),
            ("ip", "-n", srv, "link", "set", srv, "up"),
            ("ip", "-n", cli, "link", "set", cli, "up"),
            ("ip", "-n", srv, "link", "set", "lo", "up"),
            ("ip", "-n", cli, "link", "set", "lo", "up"),
        ]
        if rate_mbit is not None:
            for ns in (srv, cli):
                limit = ("tc", "qdisc", "add", "dev", ns, "root", "tbf", "rate", f"{rate_mbit}mbit")
                steps.append(("ip", "netns", "exec", ns, *limit, "burst", "64kb", "latency", "100ms"))
        for step in steps:
            result = sh(*step)
            if result.returncode != 0:
                raise Unavailable(f"network namespace set-up failed at {' '.join(step)}: {result.stderr.strip()}")
        yield srv, cli
    finally:  # (the veth pair goes with its namespaces; if it never got there, it is deleted here)
        for cmd in (("ip", "netns", "del", srv), ("ip", "netns", "del", cli), ("ip", "link", "del", srv)):
            with contextlib.suppress(subprocess.SubprocessError):
                sh(*cmd)


def inside(namespace: str, *cmd: str, own_shm: bool = False) -> list[str]:
    """`cmd` run inside `namespace`; with `own_shm`, as on a host that shares no memory with the
    other end: a /dev/shm of its own (as discovery must then find), and System V IPC and process
    ids of its own (UCX's shared-memory transports, sysv and cma, reach a peer through those)."""
    if not own_shm:
        return ["ip", "netns", "exec", namespace, *cmd]
    inner = "mount -t tmpfs tmpfs /dev/shm && exec " + shlex.join(cmd)
    unshare = ["unshare", "--mount", "--ipc", "--pid", "--fork", "--kill-child", "--mount-proc"]
    return ["ip", "netns", "exec", namespace, *unshare, "sh", "-c", inner]
