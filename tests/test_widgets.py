"""Widgets follow the cluster: a real server (with simulated GPUs, labelled as fake, because this
machine has none), a real client and its EventBus; the widget front end is tested in node and in
a real browser (test_browser.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import session_on, start_server, wait_until

import genie_core
from genie_core.events import ClusterEvent, EventType, Severity
from genie_jupyter.feed import HISTORY, MAX_RATE, ClusterFeed
from genie_jupyter.widgets import Dashboard, InitProgress


@pytest.fixture
def state(tmp_path):
    with session_on(start_server(tmp_path, "--simulate-gpus", "2", "--poll-interval", "0.2")):
        yield genie_core.get_cluster_state()


def test_gauges_follow_the_servers_readings(state):
    w = ClusterFeed(state).attach(Dashboard())
    assert wait_until(lambda: len(w.gpus) == 2 and w.gpus[0]["utilization"] is not None, 10)
    first = w.gpus[0]["utilization"]
    assert wait_until(lambda: w.gpus[0]["utilization"] != first, 10)  # they move
    assert w.gpus[0]["name"] == "Simulated GPU 0 (fake)"
    assert w.history_shape == [2, 4, HISTORY] and isinstance(w.history, bytes) and len(w.history) == 2 * 4 * HISTORY * 4
    assert w.health["grade"] in ("HEALTHY", "DEGRADED", "UNHEALTHY", "CRITICAL")
    assert w.backend["chosen"] in ("shm", "tcp", "zmq")
    assert "GPU 0 Simulated GPU 0 (fake): utilization" in w._repr_mimebundle_()[0]["text/plain"]


def test_events_lost_and_recovered_and_throttling(state):
    feed = ClusterFeed(state)
    w = feed.attach(Dashboard())
    before, start = feed.updates, time.monotonic()
    for i in range(300):
        state.events.emit(ClusterEvent(EventType.GPU_OVERHEATED, "n", Severity.WARNING, {"message": f"hot {i}"}))
    assert wait_until(lambda: w.events and w.events[0]["data"]["message"] == "hot 299", 5)
    assert len(w.events) == 200  # bounded, newest first
    elapsed = time.monotonic() - start
    assert feed.updates - before <= elapsed * MAX_RATE + 2  # 300 events, a handful of redraws
    state.events.emit(ClusterEvent(EventType.NODE_LOST, "n", Severity.ERROR, {"message": "lost", "last_seen": 123.0}))
    assert wait_until(lambda: w.status == "lost" and w.last_seen == 123.0, 5)
    state.events.emit(ClusterEvent(EventType.NODE_RECOVERED, "n", Severity.INFO, {"message": "back"}))
    assert wait_until(lambda: w.status == "live", 5)


def test_a_closed_widget_stops_costing_anything(state):
    feed = ClusterFeed(state)
    w = feed.attach(Dashboard())
    subscribers = len(state.events._subs)
    w.close()
    assert wait_until(lambda: len(state.events._subs) == subscribers - 1, 5)
    updates = feed.updates
    time.sleep(0.6)
    assert feed.updates == updates


def test_cpu_only_server_says_so(tmp_path):
    srv = start_server(tmp_path)
    try:
        st = genie_core.init_sync(f"127.0.0.1:{srv.info.port}", token=srv.info.token, timeout=20)
        w = ClusterFeed(st).attach(Dashboard())
        assert wait_until(lambda: w.cpu_only_reason != "", 10)
        assert w.gpus == [] and "CPU-only server" in w.text()
    finally:
        genie_core.shutdown_sync()
        srv.stop()


def test_init_progress_text():
    w = InitProgress(phases=[{"name": "connect", "seconds": 0.01}], summary="Connected")
    assert w.text() == "✓ connect (10 ms)\nConnected"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_front_end_unit_tests_in_node():
    js = Path(__file__).resolve().parents[1] / "js"
    result = subprocess.run(["node", "--test", "test/"], cwd=js, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "# fail 0" in result.stdout
