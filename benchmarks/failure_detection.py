"""Failure detection: seconds from SIGKILL (a crashed server) and SIGSTOP (a hung one) of the
server to the client's NODE_LOST, with the default heartbeat settings (1 s interval, 4 s
timeout). For comparison, the anchors' documented defaults (not measured here):
ipyparallel's HeartMonitor pings engines every 3 s and drops one after 10 missed beats
(`HeartMonitor.period`, `max_heartbeat_misses`); Ray's GCS marks a node dead after 5 failed
health checks 3 s apart (`health_check_period_ms`, `health_check_failure_threshold`)."""

from __future__ import annotations

import logging
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from genie_core.client import Client

from . import _servers

ANCHORS = {"ipyparallel_documented_s": 30.0, "ray_documented_s": 15.0}


def _one(sig: int) -> float:
    proc, info = _servers.start()
    client = Client(info.ip, info.port, info.token, timeout=30).connect()
    lost = threading.Event()
    client.events.subscribe(lambda e: lost.set(), types=["NODE_LOST"])
    time.sleep(1.5)
    start = time.monotonic()
    proc.send_signal(sig)
    ok = lost.wait(30)
    took = time.monotonic() - start if ok else float("inf")
    client.close(notify=False)
    if sig == signal.SIGSTOP:
        proc.send_signal(signal.SIGCONT)
    _servers.stop(proc)
    return took


def run(quick: bool = False) -> dict:
    rounds = 1 if quick else 5
    client_log = logging.getLogger("genie.client")
    level = client_log.level
    client_log.setLevel(logging.ERROR)  # "connection ... lost" is what this benchmark causes
    try:
        # quick: a crash and a hang at once (separate servers and clients); else one at a time, as measured
        with ThreadPoolExecutor(2 if quick else 1) as pool:
            kills = [pool.submit(_one, signal.SIGKILL) for _ in range(rounds)]
            stops = [pool.submit(_one, signal.SIGSTOP) for _ in range(rounds)]
            kill, stop = [f.result() for f in kills], [f.result() for f in stops]
    finally:
        client_log.setLevel(level)
    return {
        "name": "failure_detection",
        "rounds": rounds,
        "sigkill_to_node_lost_s_p50": round(statistics.median(kill), 2),
        "sigkill_to_node_lost_s_max": round(max(kill), 2),
        "sigstop_to_node_lost_s_p50": round(statistics.median(stop), 2),
        "sigstop_to_node_lost_s_max": round(max(stop), 2),
        **ANCHORS,
        "target": "a dead or hung server detected within 5 s",
        "met": max(kill + stop) <= 5.0,
    }
