"""The GPU pool (issue 15) on a real Ray cluster on this machine (a head and two worker nodes of
2 simulated GPUs each, on the loopback; in quick mode a head with 2 simulated GPUs alone):

- `init` to the first cell's answer on a free pool at rest, with a warm session per node (goal:
  under 2 s), and with none (Ray starts an actor for each session);
- a trivial cell's round trip in a pool session beside one against a direct `genie serve`,
  interleaved (goal: at most 1.3x; a pool session's client talks to its own server directly);
- placements a second: the endpoint's decision alone (FIFO and capacity over 100 nodes of 8
  GPUs, no Ray), and end to end (ask, Ray places the actor, its server starts, answer).

- the endpoint's CPU while 100 simulated nodes of 8 GPUs each push a signed reading a second (as
  the node monitors do) and a client asks for the pool's status once a second (goal: under 10% of
  one core). The readings come from another process, so only the endpoint's own thread is measured.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray address the loopback (see genie_core.pool.head)

import genie_core

from . import _servers


def _cells(client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        assert client.execute("x = 1").wait(30).content["status"] == "ok"
        out.append(time.perf_counter() - t)
    return out


def _inits(pool, token: str, n: int, warm: bool, uncounted: int = 1) -> tuple[list[float], object]:
    """`init` to the first cell's answer, `n` times on a free pool; each session but the last is
    ended. `warm`: each waits until every node has a ready warm session, as on a pool at rest.
    `uncounted` more are made first and not counted (they warm what a first session warms)."""
    times = []
    for i in range(n + uncounted):
        deadline = time.monotonic() + 60
        while warm and not pool.all_nodes_warm() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not warm or pool.all_nodes_warm(), "the pool did not warm every node within 60 s"
        t = time.perf_counter()
        state = genie_core.init_sync(f"127.0.0.1:{pool.port}", token=token, pool_gpus=1)
        assert state.client is not None
        assert state.client.execute("x = 1").wait(30).content["status"] == "ok"
        if i >= uncounted:
            times.append(time.perf_counter() - t)
        if i < n + uncounted - 1:
            genie_core.shutdown_sync()
    return times, state


def _decisions(n: int) -> float:
    """Decisions a second by the endpoint's queue and capacity logic over 100 nodes of 8 GPUs."""
    from genie_core.pool.endpoint import Pool
    from genie_core.pool.live import LiveSession
    from genie_core.pool.queue import Ask

    pool = Pool.__new__(Pool)  # the decision logic only: no Ray, no socket, no registry
    Pool.__init__(pool, db=None)
    pool.nodes.table = {f"n{i}": {"alive": True, "gpus": 8, "name": f"n{i}"} for i in range(100)}
    created: list[Ask] = []

    def create(ask: Ask) -> None:
        created.append(ask)
        pool.sessions[ask.session_id] = LiveSession(
            ask.session_id, ask.user, "", ask.gpus, None, node_id=f"n{len(created) % 100}"
        )

    pool._create = create  # type: ignore[method-assign]
    pool.intake.answer = lambda ask, reply: None  # type: ignore[method-assign]
    start = time.perf_counter()
    for i in range(n):
        pool.queue.add(Ask(f"s{i}", "u", "", 1, time.time() + 60, b"", "", b""))
        pool._place()
        if len(pool.sessions) >= 790:  # keep the pool nearly full: every decision looks at all nodes
            pool.sessions.pop(next(iter(pool.sessions)))
    took = time.perf_counter() - start
    pool.registry.close()
    return n / took


def _send_readings(sink: str, key: bytes, node_ids: list[str], seconds: float) -> None:
    """In a process of its own: what 100 node monitors send, at 1 Hz each."""
    import json

    import zmq

    from genie_core.pool.monitor_actor import sign

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(sink)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tick = time.monotonic()
        for node_id in node_ids:
            gpus = [
                {
                    "index": i,
                    "name": "NVIDIA A100 80GB",
                    "utilization": 37.0 + i,
                    "memory_used": 12 << 30,
                    "memory_total": 80 << 30,
                    "temperature": 61.0,
                }
                for i in range(8)
            ]
            body = json.dumps(
                {
                    "node_id": node_id,
                    "time": time.time(),
                    "cpu_percent": 12.5,
                    "memory_percent": 40.1,
                    "simulated": True,
                    "gpus": gpus,
                    "health": {"grade": "HEALTHY", "reasons": []},
                }
            ).encode()
            push.send_multipart([body, sign(body, key)])
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    push.close()
    ctx.term()


def simulated_node_ids(n: int) -> list[str]:
    return [f"sim{i:03d}" + "0" * 50 for i in range(n)]


def add_simulated_nodes(pool: Any, node_ids: list[str], seconds: float) -> Any:
    """Nodes of 8 simulated GPUs in the endpoint's node table, each pushing a signed reading a
    second for `seconds` (a process plays their monitors). They only report: nothing is placed
    there. Returns the sender process; `remove_simulated_nodes` undoes it all."""
    import multiprocessing

    pool.node_poll = 1e9  # keep Ray's node table from replacing the simulated nodes
    for node_id in node_ids:
        pool.nodes.table[node_id] = {
            "alive": True,
            "gpus": 8,
            "name": f"sim/{node_id[:6]}",
            "ip": "127.0.0.1",
            "death": "",
            "simulated": True,  # readings only: neither a warm session nor a placement goes there
        }
        pool.nodes.monitors[node_id] = None  # no monitor actor: the sender process plays them
    sender = multiprocessing.get_context("spawn").Process(
        target=_send_readings, args=(pool.sink, pool.nodes.key, node_ids, seconds)
    )
    sender.start()
    return sender


def remove_simulated_nodes(pool: Any, node_ids: list[str], sender: Any, node_poll: float) -> None:
    if sender is not None:
        sender.terminate()
        sender.join(30)
    pool.node_poll = node_poll
    for node_id in node_ids:
        pool.nodes.table.pop(node_id, None)
        pool.nodes.forget(node_id)


def _endpoint_cpu(pool, token: str, seconds: float) -> dict:
    """The endpoint thread's CPU while 100 nodes x 8 GPUs report at 1 Hz and a client watches."""
    import psutil

    from genie_core.client.pool import PoolClient, render_pool

    polled = pool.node_poll
    fake = simulated_node_ids(100)
    sender = add_simulated_nodes(pool, fake, seconds + 10)
    deadline = time.monotonic() + 10  # the sender starts (an interpreter), then every node reports once
    while not all(node in pool.nodes.readings for node in fake) and time.monotonic() < deadline:
        time.sleep(0.05)
    thread = next(t for t in psutil.Process().threads() if t.id == pool.thread_id)
    cpu0, t0, taken0 = thread.user_time + thread.system_time, time.monotonic(), pool.nodes.taken
    watcher = PoolClient("127.0.0.1", pool.port, token, timeout=30)
    # the pool dashboard of a notebook watching, two nodes opened (their GPUs' history is sent)
    from genie_jupyter.pool_feed import PoolFeed
    from genie_jupyter.widgets import PoolDashboard

    asker = watcher.copy()  # the feed's own socket, closed by its thread when it stops
    feed = PoolFeed(asker.ask_status, f"127.0.0.1:{pool.port}", on_stop=asker.close)
    dashboard = PoolDashboard(expanded=fake[:2])
    feed.attach(dashboard)
    bytes0, updates0, busy0 = feed.bytes_sent, feed.updates, feed.busy_seconds
    views = 0
    while time.monotonic() - t0 < seconds:
        tick = time.monotonic()
        text = render_pool(watcher.status())
        views += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    thread = next(t for t in psutil.Process().threads() if t.id == pool.thread_id)
    cpu1, t1, taken1 = thread.user_time + thread.system_time, time.monotonic(), pool.nodes.taken
    fed = {
        "dashboard_bytes_per_s_100x8": round((feed.bytes_sent - bytes0) / (t1 - t0)),
        "dashboard_updates_per_s": round((feed.updates - updates0) / (t1 - t0), 2),
        "dashboard_update_ms_python": round(1000 * (feed.busy_seconds - busy0) / max(1, feed.updates - updates0), 2),
        "dashboard_nodes_shown": len(dashboard.pool.get("nodes", [])),
    }
    feed.stop()
    watcher.close()
    remove_simulated_nodes(pool, fake, sender, polled)
    return {
        "endpoint_cpu_percent_100x8_at_1hz": round(100 * (cpu1 - cpu0) / (t1 - t0), 2),
        "endpoint_cpu_goal_under_10": 100 * (cpu1 - cpu0) / (t1 - t0) < 10,
        "readings_per_s_taken": round((taken1 - taken0) / (t1 - t0), 1),
        "status_views": views,
        "status_lines": text.count("\n") + 1,
        **fed,
    }


def run(quick: bool = False) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from genie_core.client import Client
    from genie_core.client.pool import PoolClient
    from genie_core.pool.commands import new_user_token
    from genie_core.pool.endpoint import Pool
    from genie_core.pool.head import HEALTH_CHECKS
    from genie_core.protocol import pool as wire

    n_cells = 20 if quick else 400
    n_inits, uncounted = (1, 0) if quick else (8, 1)
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={
            "node_ip_address": "127.0.0.1",
            "num_cpus": 1,
            "num_gpus": 2 if quick else 0,  # quick: the head is the one GPU node
            "include_dashboard": False,
            "_system_config": HEALTH_CHECKS,
        },
    )
    for _ in range(0 if quick else 2):
        cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, num_gpus=2)
    cluster.wait_for_nodes()
    folder = tempfile.mkdtemp(prefix="genie-bench-pool-")
    pool = Pool(
        ray_address=cluster.address,
        db=f"sqlite:///{folder}/registry.sqlite",
        port=0,
        simulate_gpus=True,
        warm_sessions=False,  # first with none, then with a warm session per node
    )
    pool.start().start_in_thread()
    token = new_user_token("bench")
    pool.registry.add_user("bench", wire.stored_key(token))
    proc, info = _servers.start("--no-ucx")
    out: dict = {"name": "pool"}
    try:
        cold = _inits(pool, token, n_inits, warm=False, uncounted=uncounted)[0]
        genie_core.shutdown_sync()
        pool.warm.enabled = True
        inits, state = _inits(pool, token, n_inits, warm=True, uncounted=uncounted)
        direct = Client(info.ip, info.port, info.token, timeout=30).connect()
        pooled = state.client
        _cells(direct, 20), _cells(pooled, 20)
        samples: dict[str, list[float]] = {"direct": [], "pool": []}
        for _ in range(n_cells):  # interleaved
            samples["direct"] += _cells(direct, 1)
            samples["pool"] += _cells(pooled, 1)
        direct.close()
        genie_core.shutdown_sync()
        ends = []  # end to end: ask, placed, connected, first answer; sequential
        for _ in range(1 if quick else 6):
            t = time.perf_counter()
            session = PoolClient("127.0.0.1", pool.port, token, timeout=60)
            placed = session.place(1)
            client = Client(placed["host"], placed["port"], placed["token"], timeout=30).connect()
            ends.append(time.perf_counter() - t)
            client.close()
            session.close()
        decisions = _decisions(500 if quick else 20000)
        out.update(_endpoint_cpu(pool, token, 2.0 if quick else 30.0))
        out.update(
            {
                "init_to_first_cell_s_p50": round(statistics.median(inits), 3),
                "init_to_first_cell_s_max": round(max(inits), 3),
                "init_goal_under_2s": statistics.median(inits) < 2.0,
                "init_to_first_cell_s_p50_no_warm_sessions": round(statistics.median(cold), 3),
                "cell_ms_p50_direct": round(1000 * statistics.median(samples["direct"]), 3),
                "cell_ms_p50_pool": round(1000 * statistics.median(samples["pool"]), 3),
                "cell_pool_vs_direct": round(
                    statistics.median(samples["pool"]) / statistics.median(samples["direct"]), 3
                ),
                "placements_per_s_decision_only_100x8": round(decisions),
                "placements_per_s_end_to_end": round(len(ends) / sum(ends), 2),
                "cells": n_cells,
            }
        )
        out["cell_goal_at_most_1_3x"] = out["cell_pool_vs_direct"] <= 1.3
    finally:
        genie_core.shutdown_sync()
        _servers.stop(proc)
        pool.stop()
        ray.shutdown()
        cluster.shutdown()
    return out
