"""Across hosts: a client in one network namespace, the server in another, joined by a veth pair
(no rate limit: the pair's own speed, which on one machine is what its CPUs can move; or
GENIE_ACROSS_HOSTS_MBIT, a tc tbf limit each way). A remote tensor's `.to(remote)` and `.cpu()`,
and `client.push`/`pull`, over the backend discovery chose there (tcp, payloads MACed: not
loopback), beside torch.distributed gloo send/recv across the same pair, round by round.

Target: across hosts, at least gloo's rate. Needs root and `ip netns`; elsewhere the
result says why it was skipped."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from . import _servers
from ._netns import SERVER_IP, Unavailable, host_pair, inside

GIB = 1024**3
HERE = Path(__file__).parent
LINE_TIMEOUT = 600.0  # seconds a peer may take for one answer (a round of 1 GiB each way, a session)


class _Peer:
    """A process in a namespace that answers each line on its stdin with lines on its stdout (read
    on a thread of its own, so that a wait for one has a deadline)."""

    def __init__(self, namespace: str, *args: str, env: dict[str, str], own_shm: bool = False) -> None:
        self.name = Path(args[0]).stem
        self.proc = subprocess.Popen(
            inside(namespace, sys.executable, *args, own_shm=own_shm),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # the end

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def line(self, timeout: float = LINE_TIMEOUT) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name} said nothing for {timeout:g} s") from None
        if not line:
            raise RuntimeError(f"{self.name} ended early (exit status {self.proc.poll()})")
        return line

    def close(self) -> None:
        """End it (its stdin closed: it finishes; past a minute it is killed)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run(quick: bool = False) -> dict:
    nbytes = (32 if quick else 1024) << 20
    rounds = 2 if quick else 5
    limit = os.environ.get("GENIE_ACROSS_HOSTS_MBIT")
    out: dict = {"name": "across_hosts", "mib": nbytes >> 20, "rounds": rounds}
    out["link"] = f"veth pair, tc tbf {limit} Mbit/s each way" if limit else "veth pair, no rate limit"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
    with contextlib.ExitStack() as stack:
        try:
            srv_ns, cli_ns = stack.enter_context(host_pair(int(limit) if limit else None))
        except Unavailable as exc:
            return {**out, "skipped": str(exc)}
        proc, info = _servers.start("--ip", SERVER_IP, prefix=tuple(inside(srv_ns)))
        stack.callback(_servers.stop, proc)
        peers: list[_Peer] = []
        stack.callback(lambda: [peer.close() for peer in peers])
        client = _Peer(
            cli_ns,
            str(HERE / "_across_hosts_client.py"),
            f"{SERVER_IP}:{info.port}",
            info.token,
            str(nbytes),
            env=env,
            own_shm=True,  # another host shares no memory: discovery must not find shm
        )
        peers.append(client)
        gloo_port = "29517"  # inside the server's namespace, where nothing else listens
        for rank, ns in ((0, srv_ns), (1, cli_ns)):  # rank 0 sends: the server-to-client direction
            # (TORCH_CPP_LOG_LEVEL: c10d warns that a namespace cannot name its peer's address)
            gloo_env = dict(env, MASTER_ADDR=SERVER_IP, GLOO_SOCKET_IFNAME=ns, TORCH_CPP_LOG_LEVEL="ERROR")
            peers.append(_Peer(ns, str(HERE / "_gloo_peer.py"), str(rank), str(nbytes), gloo_port, env=gloo_env))
        session = json.loads(client.line())
        for peer in peers[1:]:
            if peer.line().strip() != "ready":
                raise RuntimeError("a gloo peer did not start")
        times: dict[str, list[float]] = {}
        for _ in range(rounds):
            client.send("go")
            for key, took in json.loads(client.line()).items():
                times.setdefault(key, []).append(took)
            for peer in peers[1:]:
                peer.send("go")
            times.setdefault("gloo", []).append(float(peers[2].line()))
    rate = {k: nbytes / statistics.median(v) / GIB for k, v in times.items()}
    candidates = {c["name"]: c for c in session["candidates"]}
    out["chosen_backend"] = session["chosen"]
    out["discovery"] = session["reason"]
    out["discovery_s"] = session["elapsed_s"]
    out["shm_available"] = bool(candidates.get("shm", {}).get("available"))
    out.update({f"{k}_gib_s": round(v, 3) for k, v in rate.items()})
    for key in ("to_remote", "cpu", "push", "pull"):
        out[f"{key}_vs_gloo"] = round(rate[key] / rate["gloo"], 2)
    out["targets"] = "across hosts: .to(remote), .cpu(), push and pull at least gloo's rate"
    out["met"] = {f"{key}_vs_gloo": rate[key] >= rate["gloo"] for key in ("to_remote", "cpu", "push", "pull")}
    return out
