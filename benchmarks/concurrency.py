"""Concurrency: 16 clients (16 sessions, 16 workers) running trivial cells at once against one
server: throughput, p99 and errors, beside the single-client p50. Target (issue 7): zero errors
and p99 under 10x the single-client p50."""

from __future__ import annotations

import statistics
import threading
import time

from genie_core.client import Client

from . import _servers


def run(quick: bool = False) -> dict:
    clients_n = 4 if quick else 16
    cells = 20 if quick else 100
    proc, info = _servers.start()
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    try:
        single = Client(info.ip, info.port, info.token, timeout=60).connect()
        for _ in range(20):
            single.execute("x = 1").wait(30)
        solo = []
        for _ in range(cells):
            start = time.perf_counter()
            single.execute("x = 1").wait(30)
            solo.append(time.perf_counter() - start)
        single.close()

        clients = [Client(info.ip, info.port, info.token, timeout=60).connect() for _ in range(clients_n)]
        for c in clients:  # each session's worker starts on its first cell
            c.execute("x = 1").wait(120)
        barrier = threading.Barrier(clients_n)

        def work(c: Client) -> None:
            barrier.wait()
            for i in range(cells):
                start = time.perf_counter()
                try:
                    reply = c.execute(f"y = {i} * 2").wait(60)
                    if reply.content.get("status") != "ok":
                        raise RuntimeError(reply.content)
                except Exception as exc:  # counted, not raised: the benchmark reports errors
                    with lock:
                        errors.append(repr(exc))
                    continue
                with lock:
                    latencies.append(time.perf_counter() - start)

        threads = [threading.Thread(target=work, args=(c,)) for c in clients]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        for c in clients:
            c.close()
    finally:
        _servers.stop(proc)
    p99 = sorted(latencies)[int(0.99 * (len(latencies) - 1))] if latencies else float("inf")
    solo_p50 = statistics.median(solo)
    return {
        "name": "concurrency",
        "clients": clients_n,
        "cells_per_client": cells,
        "errors": len(errors),
        "throughput_cells_per_s": round(len(latencies) / wall, 1),
        "single_client_ms_p50": round(1000 * solo_p50, 3),
        "concurrent_ms_p50": round(1000 * statistics.median(latencies), 3),
        "concurrent_ms_p99": round(1000 * p99, 3),
        "p99_over_single_p50": round(p99 / solo_p50, 1),
        "target": "zero errors; p99 < 10 x single-client p50",
        "met": not errors and p99 < 10 * solo_p50,
    }
