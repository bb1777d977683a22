"""Events, metric snapshots and health reach clients over real sockets; `genie status` / `top`."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import run, start_server, stdout_of, wait_until, worker_pid

from genie_core.client import Client
from genie_core.config import ClusterConfig
from genie_core.events import EventType
from genie_core.monitoring import Grade, StaticGPUSource
from genie_core.monitoring.health import HealthThresholds
from genie_core.nodes import GPUInfo
from genie_core.server import Server
from genie_core.terminal import gpu_processes


@pytest.fixture
def injected(tmp_path):
    """An in-process server whose GPU readings the test sets (StaticGPUSource: a labelled fake),
    reached by a real client over TCP."""
    readings = {
        "gpus": [GPUInfo(0, name="Fake GPU (test)", utilization=5.0, temperature=50.0, temperature_slowdown=90.0)]
    }
    config = ClusterConfig.resolve(
        node_role="server",
        master_port=0,
        token="obs-token",
        gpu_poll_interval=0.1,
        health_check_interval=0.1,
        state_dir=str(tmp_path),
        node_id="obs-node",
    )
    server = (
        Server(config, gpu_source=StaticGPUSource(lambda: readings["gpus"]), spare_workers=0).start().start_in_thread()
    )
    # Grade the injected GPU only: a CI host short of memory or disk would otherwise degrade the node
    # before the test does, and going from DEGRADED to UNHEALTHY emits no NODE_DEGRADED.
    server.monitor.health.thresholds = HealthThresholds(
        memory_degraded_percent=101,
        memory_unhealthy_percent=101,
        disk_degraded_percent=101,
        disk_unhealthy_percent=101,
    )
    client = Client("127.0.0.1", server.port, "obs-token", timeout=10).connect()
    yield readings, server, client
    client.close()
    server.stop()


def test_server_events_and_snapshots_reach_the_client(injected):
    readings, _, client = injected
    seen = []
    client.events.subscribe(seen.append)
    assert wait_until(lambda: client.metrics is not None and client.server_health is not None, 5)
    assert client.metrics.gpus[0].name == "Fake GPU (test)" and client.metrics.memory_total > 0
    readings["gpus"] = [
        GPUInfo(
            0, name="Fake GPU (test)", utilization=5.0, temperature=89.0, temperature_slowdown=90.0, ecc_volatile_dbe=2
        )
    ]
    assert wait_until(
        lambda: {EventType.GPU_OVERHEATED, EventType.HEALTH_CHANGED, EventType.NODE_DEGRADED} <= {e.type for e in seen},
        5,
    )
    assert wait_until(lambda: client.health.grade is Grade.UNHEALTHY, 5)
    assert any("double-bit" in r for r in client.health.reasons)
    readings["gpus"] = [
        GPUInfo(0, name="Fake GPU (test)", utilization=5.0, temperature=50.0, temperature_slowdown=90.0)
    ]
    assert wait_until(lambda: EventType.NODE_RECOVERED in {e.type for e in seen}, 5)
    assert wait_until(lambda: client.health.grade is Grade.HEALTHY, 5)


def test_client_side_events(injected):
    _, server, client = injected
    client.select_backend()
    types = [e.type for e in client.events.history()]
    assert types[:2] == [EventType.CONNECTED, EventType.BACKEND_SELECTED]
    backend = client.events.history(["BACKEND_SELECTED"])[0]
    assert (
        backend.data["backend"] in ("shm", "tcp", "zmq") and backend.data["report"]["chosen"] == backend.data["backend"]
    )
    assert "/s" in backend.message
    other = Client("127.0.0.1", server.port, "obs-token", timeout=10).connect()
    other.close()
    assert wait_until(lambda: EventType.SESSION_CLOSED in {e.type for e in client.events.history()}, 5)


def test_snapshots_keep_coming_while_a_cell_runs(injected):
    _, _, client = injected
    stamps = []
    client.events.subscribe(lambda e: stamps.append(time.monotonic()), types=[EventType.METRICS])
    request = client.execute("import time\ntime.sleep(2)")
    list(request.replies(20))
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert len(stamps) >= 10 and max(gaps) < 0.6


def test_status_json_against_a_real_server(tmp_path):
    srv = start_server(tmp_path, "--node-id", "status-node")
    try:
        user = srv.client()
        run(user, "x = 1")
        time.sleep(1.2)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "genie_core",
                "status",
                f"127.0.0.1:{srv.info.port}",
                "--token",
                srv.info.token,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr
        info = json.loads(result.stdout)
        assert info["node"]["node_id"] == "status-node"
        assert info["metrics"]["gpus"] == [] and info["metrics"]["gpu_reason"]  # this machine: no GPU, with the reason
        assert info["metrics"]["memory_total"] > 0 and info["metrics"]["cpu_count"] >= 1
        assert info["health"]["grade"] in {g.value for g in Grade}
        assert {c["name"] for c in info["health"]["checks"]} >= {"cpu", "memory", "disk"}
        users = [s for s in info["sessions"] if s["client"].get("purpose") != "probe"]
        assert len(users) == 1 and users[0]["workers"][0]["pid"] > 0
        user.close()
    finally:
        srv.stop()


def test_status_text_and_top_with_simulated_gpus(tmp_path):
    srv = start_server(tmp_path, "--simulate-gpus", "2", "--poll-interval", "0.2")
    try:
        env = dict(os.environ, GENIE_TOKEN=srv.info.token)
        env.pop("COLUMNS", None)  # piped, with no width to go by: nothing is wrapped
        addr = f"127.0.0.1:{srv.info.port}"
        text = subprocess.run(
            [sys.executable, "-m", "genie_core", "status", addr], capture_output=True, text=True, timeout=30, env=env
        ).stdout
        assert "health" in text and "SIMULATED" in text and "Simulated GPU 1 (fake)" in text
        host = next(line for line in text.splitlines() if line.startswith("host"))
        assert "load" in host and "memory" in host and host.rstrip().endswith("free") and len(host) > 80, text
        env["COLUMNS"] = "160"
        top = subprocess.run(
            [sys.executable, "-m", "genie_core", "top", addr, "--iterations", "3"],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        assert top.returncode == 0 and "°C" in top.stdout
    finally:
        srv.stop()


def test_status_without_a_server_is_one_clear_line(tmp_path):
    env = dict(os.environ, GENIE_RUNTIME_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "genie_core", "status"], capture_output=True, text=True, timeout=30, env=env
    )
    assert result.returncode == 2 and "no running genie server" in result.stderr and "Traceback" not in result.stderr


def test_monitoring_settings_take_effect_from_the_environment(tmp_path):
    srv = start_server(tmp_path, env={"GENIE_GPU_POLL_INTERVAL": "0.2"})
    try:
        client = srv.client()
        stamps = []
        client.events.subscribe(lambda e: stamps.append(time.monotonic()), types=[EventType.METRICS])
        time.sleep(1.5)
        assert len(stamps) >= 5
        client.close()
    finally:
        srv.stop()
    srv = start_server(tmp_path, env={"GENIE_ENABLE_GPU_MONITORING": "false"})
    try:
        client = srv.client()
        time.sleep(1.5)
        info = client.info()
        assert client.metrics is None and info["monitoring"]["enabled"] is False and info["health"] is None
        client.close()
    finally:
        srv.stop()


def test_history_and_events_survive_a_restart(tmp_path):
    state = {"GENIE_STATE_DIR": str(tmp_path / "shared-state")}
    srv = start_server(tmp_path, "--node-id", "durable", "--poll-interval", "0.2", env=state)
    client = srv.client()
    run(client, "1")
    client.close()  # a SESSION_CLOSED event, stored
    time.sleep(1.0)
    srv.stop()
    restarted_at = time.time()
    srv = start_server(tmp_path, "--node-id", "durable", env=state)
    try:
        probe = srv.client()
        info = probe.info(history_points=1000)
        assert any(t < restarted_at for t, _ in info["history"]["cpu_percent"])
        assert any(e["type"] == "SESSION_CLOSED" and e["time"] < restarted_at for e in info["events"])
        probe.close()
    finally:
        srv.stop()


def test_gpu_memory_and_utilization_are_shown_per_session(injected):
    """NVML's per-process readings (a labelled fake here: the pids are real, the GPU is not) are
    mapped to the sessions whose workers (or what the workers started) they are."""
    readings, _, client = injected
    worker = worker_pid(client)
    child = subprocess.Popen(["sleep", "30"])  # not a session's: it belongs to the test
    readings["gpus"] = [
        GPUInfo(
            0,
            name="Fake GPU (test)",
            utilization=60.0,
            temperature=50.0,
            processes=[
                {"pid": worker, "memory_used": 3 << 30, "sm_util": 45.0, "memory_util": 20.0},
                {"pid": child.pid, "memory_used": 1 << 30, "sm_util": 5.0, "memory_util": 1.0},
            ],
        )
    ]
    try:
        assert wait_until(lambda: client.metrics is not None and client.metrics.gpus[0].processes, 5)
        assert wait_until(lambda: client.metrics.gpus[0].processes[0].get("session") == client.session[:8], 5)
        mine, other = client.metrics.gpus[0].processes
        assert mine["user"] == os.environ.get("USER", "") and "session" not in other
        info = client.info()
        text = "\n".join(gpu_processes(info["metrics"]["gpus"]))
        assert f"pid {worker}" in text and "3.00 GiB, SM 45%" in text and f"session {client.session[:8]}" in text
        assert f"pid {child.pid}" in text and "not a genie session" in text
        # What a cell starts counts as its session's too.
        grandchild = int(
            stdout_of(run(client, "import subprocess\np = subprocess.Popen(['sleep', '30'])\nprint(p.pid)"))
        )
        readings["gpus"][0].processes[1]["pid"] = grandchild
        assert wait_until(lambda: client.metrics.gpus[0].processes[1].get("session") == client.session[:8], 5)
    finally:
        child.kill()
        child.wait()
