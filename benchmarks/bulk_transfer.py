"""Bulk transfer: a 256 MiB tensor pushed to and pulled from the server through each Genie
backend, beside torch.distributed gloo send/recv, ipyparallel push/pull (when installed) and a
preallocated memcpy (the same-host limit), interleaved round by round on the same machine.

Targets (issues 4 and 5): tcp at least gloo's throughput; shm at least half of memcpy; push at
least 2x ipyparallel's push."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from genie_core.client import Client
from genie_core.config import ConnectionInfo

from . import _ipyparallel, _servers

GIB = 1024**3


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


class Gloo:
    def __init__(self, nbytes: int) -> None:
        port, script = _free_port(), str(Path(__file__).with_name("_gloo_peer.py"))
        self.peers = [
            subprocess.Popen(
                [sys.executable, script, str(r), str(nbytes), port],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]

    def wait_ready(self) -> None:
        for p in self.peers:
            assert p.stdout.readline().strip() == "ready"

    def once(self) -> float:
        for p in self.peers:
            p.stdin.write("go\n")
            p.stdin.flush()
        return float(self.peers[1].stdout.readline())

    def close(self) -> None:
        for p in self.peers:
            p.stdin.close()
            p.wait(30)


def _timed(fn) -> float:
    """Seconds `fn` takes; what it returns is kept until the clock has stopped (as a user keeps a
    pulled tensor), so freeing it is not counted against anyone."""
    start = time.perf_counter()
    result = fn()
    took = time.perf_counter() - start
    del result
    return took


def _discovery_choices(info: ConnectionInfo, connections: int) -> dict:
    """Connect `connections` times in a row with automatic backend choice: which backend won each
    time, and the bandwidths discovery measured for the two same-host contenders."""
    chosen: dict[str, int] = {}
    measured: dict[str, list[float]] = {"shm": [], "tcp": []}
    for _ in range(connections):
        c = Client(info.ip, info.port, info.token, timeout=30).connect()
        try:
            report = c.select_backend("auto")
        finally:
            c.close()
        chosen[report.chosen] = chosen.get(report.chosen, 0) + 1
        for name in measured:
            bw = report.candidate(name).bandwidth
            if bw:
                measured[name].append(bw / GIB)
    return {
        "connections": connections,
        "chosen": chosen,
        **{
            f"probe_{n}_gib_s_min_median_max": [round(f(v), 2) for f in (min, statistics.median, max)]
            for n, v in measured.items()
            if v
        },
    }


def run(quick: bool = False) -> dict:
    nbytes = (16 if quick else 256) << 20
    rounds = 2 if quick else 7
    t = torch.randn(nbytes // 4)
    proc, info = _servers.start()
    clients = {}
    results: dict[str, list[float]] = {}
    try:
        choices = _discovery_choices(info, 3 if quick else 20)
        for backend in ("tcp", "shm", "zmq"):
            c = Client(info.ip, info.port, info.token, timeout=30).connect()
            c.select_backend(backend)
            clients[backend] = c
        gloo = Gloo(nbytes)  # its peers start while the ipyparallel cluster does
        ipp_rc = _ipyparallel.client()
        view = ipp_rc[:] if ipp_rc is not None else None
        gloo.wait_ready()
        dst = torch.empty_like(t)
        for c in clients.values():  # warm: the first transfer maps memory everywhere
            c.push({"t": t})
            c.pull(["t"])
        for _ in range(rounds):  # interleaved: noise hits every contender alike
            for name, c in clients.items():
                results.setdefault(f"genie_{name}_push", []).append(_timed(lambda c=c: c.push({"t": t})))
                results.setdefault(f"genie_{name}_pull", []).append(_timed(lambda c=c: c.pull(["t"])))
            results.setdefault("gloo_send_recv", []).append(gloo.once())
            results.setdefault("memcpy_preallocated", []).append(_timed(lambda: dst.copy_(t)))
            if view is not None:
                results.setdefault("ipyparallel_push", []).append(_timed(lambda: view.push({"t": t}, block=True)))
                results.setdefault("ipyparallel_pull", []).append(_timed(lambda: view.pull("t", block=True)))
        gloo.close()
        if view is not None:
            view.execute("del t", block=True)  # the engine is shared with the next benchmarks
    finally:
        for c in clients.values():
            c.close()
        _servers.stop(proc)
    rate = {k: nbytes / statistics.median(v) / GIB for k, v in results.items()}
    p99 = {k: nbytes / max(v) / GIB for k, v in results.items()}
    out = {"name": "bulk_transfer", "mib": nbytes >> 20, "rounds": rounds}
    for k in results:
        out[f"{k}_gib_s_p50"] = round(rate[k], 3)
        out[f"{k}_gib_s_worst"] = round(p99[k], 3)
    out["tcp_push_vs_gloo"] = round(rate["genie_tcp_push"] / rate["gloo_send_recv"], 2)
    out["tcp_pull_vs_gloo"] = round(rate["genie_tcp_pull"] / rate["gloo_send_recv"], 2)
    out["shm_push_vs_memcpy"] = round(rate["genie_shm_push"] / rate["memcpy_preallocated"], 3)
    out["shm_pull_vs_memcpy"] = round(rate["genie_shm_pull"] / rate["memcpy_preallocated"], 3)
    out["discovery_in_a_row"] = choices
    if "ipyparallel_push" in rate:
        best = max(rate["genie_tcp_push"], rate["genie_shm_push"])
        out["best_push_vs_ipyparallel_push"] = round(best / rate["ipyparallel_push"], 2)
    out["targets"] = (
        "tcp push and pull >= gloo; shm >= 0.5 x memcpy; the same backend chosen on every connection; "
        "push >= 2 x ipyparallel push"
    )
    out["met"] = {
        "tcp_vs_gloo": out["tcp_push_vs_gloo"] >= 1.0 and out["tcp_pull_vs_gloo"] >= 1.0,
        "shm_vs_memcpy": out["shm_push_vs_memcpy"] >= 0.5,
        "same_choice_every_connection": len(choices["chosen"]) == 1,
        "vs_ipyparallel": out.get("best_push_vs_ipyparallel_push", 0) >= 2.0
        if "ipyparallel_push" in rate
        else "ipyparallel not installed",
    }
    return out
