"""Connect time: `init` to ready (handshake and backend discovery) against a running server,
and with the embedded local server; beside ipyparallel's `Cluster(n=1).start_and_connect_sync()`.
Targets (issue 7): 0.3 s and 2 s."""

from __future__ import annotations

import statistics
import time

import genie_core

from . import _servers


def run(quick: bool = False) -> dict:
    rounds = 2 if quick else 7
    proc, info = _servers.start()
    running, embedded, ipp_times = [], [], []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            genie_core.init_sync(f"{info.ip}:{info.port}", token=info.token, timeout=30)
            running.append(time.perf_counter() - start)
            genie_core.shutdown_sync()
            start = time.perf_counter()
            genie_core.init_sync(timeout=30)
            embedded.append(time.perf_counter() - start)
            genie_core.shutdown_sync()
            if quick or len(ipp_times) >= 3:  # each start takes seconds (6.6 s here)
                continue
            try:
                import ipyparallel as ipp
            except ImportError:
                continue
            cluster = ipp.Cluster(n=1, log_level=40)
            start = time.perf_counter()
            rc = cluster.start_and_connect_sync()
            rc.wait_for_engines(1, timeout=60)
            ipp_times.append(time.perf_counter() - start)
            rc.close()
            cluster.stop_cluster_sync()
    finally:
        _servers.stop(proc)
    out = {
        "name": "connect_time",
        "rounds": rounds,
        "running_server_s_p50": round(statistics.median(running), 3),
        "running_server_s_max": round(max(running), 3),
        "embedded_server_s_p50": round(statistics.median(embedded), 3),
        "embedded_server_s_max": round(max(embedded), 3),
        "note": "both include backend discovery (default budget 0.3 s)",
        "targets": "running server 0.3 s; embedded server 2 s",
    }
    if ipp_times:
        out["ipyparallel_cluster_n1_s_p50"] = round(statistics.median(ipp_times), 3)
    elif quick:
        out["ipyparallel_cluster_n1_s_p50"] = "not measured in a quick run"
    out["met"] = statistics.median(running) <= 0.3 and statistics.median(embedded) <= 2.0
    return out
