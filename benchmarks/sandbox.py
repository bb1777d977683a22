"""What the sandbox per session worker costs (issue 22): a server with `--sandbox` beside one
without, in one run, interleaved. Targets: a worker's start at most 50 ms more (spare workers
hide it from users; measured here with none, the first cell of a new session); a trivial cell and
a 256 MiB push over shared memory within 5% of the unsandboxed server's."""

from __future__ import annotations

import os
import shutil
import statistics
import time

import torch

from genie_core.client import Client

from . import _servers

MiB = 1 << 20


def _client(info) -> Client:
    return Client(info.ip, info.port, info.token, timeout=60).connect()


def _first_cell(info) -> float:
    """A new session's first cell on a server with no spare worker: the worker's start, mostly."""
    client = _client(info)
    try:
        start = time.perf_counter()
        client.execute("x = 1").wait(60)
        return time.perf_counter() - start
    finally:
        client.close()


def run(quick: bool = False) -> dict:
    if shutil.which("bwrap") is None or os.geteuid() != 0:
        return {"name": "sandbox", "met": "not measured: needs bubblewrap and root"}
    starts, cells, pushes = (3, 30, 3) if quick else (15, 300, 30)
    kinds = {"plain": (), "sandbox": ("--sandbox", "--session-network", "outbound")}
    old_spares = os.environ.get("GENIE_SPARE_WORKERS")
    os.environ["GENIE_SPARE_WORKERS"] = "0"
    try:
        servers = {kind: _servers.start("--no-ucx", *args) for kind, args in kinds.items()}
    finally:
        if old_spares is None:
            os.environ.pop("GENIE_SPARE_WORKERS")
        else:
            os.environ["GENIE_SPARE_WORKERS"] = old_spares
    samples: dict[str, dict[str, list[float]]] = {k: {"start": [], "cell": [], "push": []} for k in kinds}
    clients: dict[str, Client] = {}
    try:
        for _ in range(starts):
            for kind, (_, info) in servers.items():
                samples[kind]["start"].append(_first_cell(info))
        for kind, (_, info) in servers.items():
            clients[kind] = _client(info)
            clients[kind].select_backend("shm")
            clients[kind].execute("x = 1").wait(60)
        for _ in range(cells):
            for kind, client in clients.items():
                start = time.perf_counter()
                client.execute("x = 1").wait(30)
                samples[kind]["cell"].append(time.perf_counter() - start)
        payload = torch.ones((256 if not quick else 64) * MiB // 4)
        for _ in range(pushes + 1):
            for kind, client in clients.items():
                start = time.perf_counter()
                client.push({"payload": payload})
                samples[kind]["push"].append(time.perf_counter() - start)
    finally:
        for client in clients.values():
            client.close()
        for proc, _ in servers.values():
            _servers.stop(proc)
    out: dict = {"name": "sandbox", "push_mib": 256 if not quick else 64}
    med = {k: {m: statistics.median(v[m][1:] if m == "push" else v[m]) for m in v} for k, v in samples.items()}
    for kind in kinds:
        out[f"{kind}_worker_start_ms_p50"] = round(1000 * med[kind]["start"], 1)
        out[f"{kind}_cell_ms_p50"] = round(1000 * med[kind]["cell"], 3)
        out[f"{kind}_push_gib_s"] = round(out["push_mib"] / 1024 / med[kind]["push"], 2)
    extra_start = 1000 * (med["sandbox"]["start"] - med["plain"]["start"])
    cell_ratio = med["sandbox"]["cell"] / med["plain"]["cell"]
    push_ratio = med["sandbox"]["push"] / med["plain"]["push"]
    out["sandbox_extra_start_ms"] = round(extra_start, 1)
    out["sandbox_cell_ratio"] = round(cell_ratio, 3)
    out["sandbox_push_ratio"] = round(push_ratio, 3)
    out["target"] = "start +50 ms at most; cell and 256 MiB shm push within 5%"
    out["met"] = extra_start <= 50 and cell_ratio <= 1.05 and push_ratio <= 1.05
    return out
