"""A real "other host": the server and the client in two network namespaces joined by a veth
pair, rate-limited with tc tbf, the client with its own /dev/shm. Discovery must see a slow link
and no shared memory; transfers must still be bit-exact (with payload HMACs: not loopback)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import STRESS

from benchmarks._netns import SERVER_IP, Unavailable, host_pair, inside, sh
from genie_core.local_server import start_server_process, stop_process

RATE_MBIT = 200


@pytest.fixture
def hosts():
    try:
        with host_pair(RATE_MBIT) as pair:
            yield pair
    except Unavailable as exc:
        pytest.skip(str(exc))


@contextlib.contextmanager
def server_in(namespace: str, tmp_path, **env: str):
    """`genie serve` on SERVER_IP inside `namespace` (its log in tmp_path); yields its ConnectionInfo."""
    full_env = dict(
        os.environ, GENIE_TOKEN="netns-" + os.urandom(8).hex(), GENIE_STATE_DIR=str(tmp_path / "state"), **env
    )
    with open(tmp_path / "server.log", "w") as log:  # a file, not a pipe nobody reads
        server, info, _ = start_server_process(
            "--ip",
            SERVER_IP,
            "--port",
            "0",
            env=full_env,
            connection_file=tmp_path / "server.json",
            stderr=log,
            prefix=tuple(inside(namespace)),
        )
    try:
        yield info
    finally:
        stop_process(server)


CLIENT = textwrap.dedent("""
    import json, sys, torch, genie_core
    state = genie_core.init_sync(sys.argv[1], token=sys.argv[2], timeout=20, discovery_budget=1.0)
    t = torch.randn(1 << 20)  # 4 MiB
    state.client.push({"t": t})
    back = state.client.pull(["t"])["t"]
    print(json.dumps({"report": state.backend_report.to_dict(), "equal": bool(torch.equal(back, t))}))
    genie_core.shutdown_sync()
""")


def test_discovery_across_a_rate_limited_link(hosts, tmp_path):
    srv_ns, cli_ns = hosts
    with server_in(srv_ns, tmp_path) as info:
        script = tmp_path / "client.py"
        script.write_text(CLIENT)
        start = time.monotonic()
        result = subprocess.run(
            inside(cli_ns, sys.executable, str(script), f"{SERVER_IP}:{info.port}", info.token, own_shm=True),
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=os.getcwd()),
        )
        assert result.returncode == 0, result.stderr[-2000:]
        out = json.loads(result.stdout.strip().splitlines()[-1])
        report = {c["name"]: c for c in out["report"]["candidates"]}
        assert out["equal"]
        assert not report["shm"]["available"] and "not visible here" in report["shm"]["reason"]
        tcp = report["tcp"]
        assert tcp["available"] and tcp["details"]["payload_mac"] is True  # off loopback: payloads are MACed
        link = RATE_MBIT * 1e6 / 8
        assert 0.3 * link < tcp["bandwidth"] < 1.3 * link, (
            f"measured {tcp['bandwidth'] / 1e6:.1f} MB/s on a {link / 1e6:.0f} MB/s link"
        )
        assert out["report"]["chosen"] in ("tcp", "zmq", "ucx")
        print(
            f"\nnetns link {link / 1e6:.0f} MB/s: tcp measured {tcp['bandwidth'] / 1e6:.1f} MB/s, "
            f"rtt {tcp['rtt_s'] * 1e3:.2f} ms; zmq {report['zmq']['bandwidth'] / 1e6:.1f} MB/s; "
            f"chose {out['report']['chosen']}: {out['report']['reason']}"
        )
        assert time.monotonic() - start < 60


DELAY_S = 0.01


def test_round_trips_reflect_a_delayed_link(hosts, tmp_path):
    """Control and data connections go through a relay in the client's namespace that holds
    every chunk back 10 ms each way: discovery's round trips must show the 20 ms."""
    srv_ns, cli_ns = hosts
    relay = None
    with server_in(srv_ns, tmp_path, GENIE_DATA_PORT="17100") as info:
        try:
            relay = subprocess.Popen(
                inside(
                    cli_ns,
                    sys.executable,
                    os.path.join(os.path.dirname(__file__), "delay_relay.py"),
                    "17001",
                    SERVER_IP,
                    str(info.port),
                    str(DELAY_S),
                    "17002",
                    SERVER_IP,
                    "17100",
                    str(DELAY_S),
                ),
                stdout=subprocess.PIPE,
                text=True,
            )
            assert relay.stdout.readline().strip() == "relaying"
            script = tmp_path / "client.py"
            script.write_text(
                textwrap.dedent("""
                import json, sys, genie_core
                state = genie_core.init_sync(
                    sys.argv[1], token=sys.argv[2], timeout=20, data_port=17002, discovery_budget=2.0
                )
                print(json.dumps(state.backend_report.to_dict()))
                genie_core.shutdown_sync()
            """)
            )
            result = subprocess.run(
                inside(cli_ns, sys.executable, str(script), "127.0.0.1:17001", info.token, own_shm=True),
                capture_output=True,
                text=True,
                timeout=120,
                env=dict(os.environ, PYTHONPATH=os.getcwd()),
            )
            assert result.returncode == 0, result.stderr[-2000:]
            report = {c["name"]: c for c in json.loads(result.stdout.strip().splitlines()[-1])["candidates"]}
            for name in ("tcp", "zmq"):
                assert report[name]["available"], report[name]["reason"]
                assert 2 * DELAY_S <= report[name]["rtt_s"] < 2 * DELAY_S + 0.05, (name, report[name]["rtt_s"])
            print(
                f"\nrelay delay {DELAY_S * 1e3:.0f} ms each way: tcp rtt {report['tcp']['rtt_s'] * 1e3:.1f} ms, "
                f"zmq rtt {report['zmq']['rtt_s'] * 1e3:.1f} ms"
            )
        finally:
            if relay is not None:
                relay.kill()
                relay.wait()


PARTITION_CLIENT = textwrap.dedent("""
    import json, sys, time, genie_core
    from genie_core.errors import ConnectionLost

    def step(name):
        print(name, flush=True)
        assert sys.stdin.readline().strip() == "done"

    def lost_then_settled(request, lost):
        t0 = time.monotonic()
        try:
            request.wait(60)
            raise SystemExit("the request finished although the link was cut")
        except ConnectionLost as exc:
            detected = time.monotonic() - t0
            message = str(exc)
        step("heal")
        healed = time.monotonic()
        recovered = None
        for _ in range(600):  # bounded: 60 s
            if recovered is None and client.connected:
                recovered = time.monotonic() - healed
            if recovered is not None and lost[request.id].settled:
                break
            time.sleep(0.1)
        r = lost[request.id]
        return {"detected_s": detected, "recovered_s": recovered, "settled_s": time.monotonic() - healed,
                "message": message, "state": r.state, "status": r.status, "output": r.output, "describe": r.describe()}

    state = genie_core.init_sync(sys.argv[1], token=sys.argv[2], timeout=20, backend="zmq")
    client = state.client
    lost = client.lost_requests
    client.execute("runs = []").wait(10)
    out = {}
    # 1. The link is cut before the cell is sent: it travels once the link heals.
    step("cut")
    during = client.execute("runs.append('during'); print('ran during the partition')")
    out["sent_during"] = lost_then_settled(during, lost)
    # 2. The link is cut while the cell runs: its answer comes after the heal.
    request = client.execute("import time; time.sleep(1.5); runs.append('before'); print('ran across the partition')")
    time.sleep(0.5)
    step("cut")
    out["running_when_cut"] = lost_then_settled(request, lost)
    out["runs"] = client.pull(["runs"])["runs"]
    print("RESULT " + json.dumps(out), flush=True)
    genie_core.shutdown_sync()
""")

PARTITION = """table inet genie_partition {{
  chain out {{ type filter hook output priority 0; policy accept; ip daddr {ip} drop; }}
  chain in {{ type filter hook input priority 0; policy accept; ip saddr {ip} drop; }}
}}"""


def _run_partitioned(hosts, tmp_path, client_code: str, server_env: dict[str, str] | None = None) -> dict:
    """A server in one namespace, `client_code` in the other; the client prints "cut" or "heal"
    when it wants the link cut (nftables drops everything) or healed, and "RESULT {json}" at the end."""
    if shutil.which("nft") is None:
        pytest.skip("nftables (nft) is not installed")
    srv_ns, cli_ns = hosts
    client = None
    with server_in(srv_ns, tmp_path, **(server_env or {})) as info:
        try:
            script = tmp_path / "client.py"
            script.write_text(client_code)
            client = subprocess.Popen(
                inside(cli_ns, sys.executable, str(script), f"{SERVER_IP}:{info.port}", info.token),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(os.environ, PYTHONPATH=os.getcwd()),
            )
            seen: list[str] = []
            for _ in range(200):  # bounded: the cuts, the heals, the result (and whatever else it prints)
                line = client.stdout.readline().strip()
                seen.append(line)
                if line == "cut":
                    r = subprocess.run(
                        inside(cli_ns, "nft", "-f", "-"),
                        input=PARTITION.format(ip=SERVER_IP),
                        capture_output=True,
                        text=True,
                        timeout=10,
                    )
                    assert r.returncode == 0, r.stderr
                elif line == "heal":
                    r = sh(*inside(cli_ns, "nft", "delete", "table", "inet", "genie_partition"))
                    assert r.returncode == 0, r.stderr
                elif line.startswith("RESULT "):
                    return json.loads(line[len("RESULT ") :])
                elif not line and client.poll() is not None:
                    break
                if line in ("cut", "heal"):
                    client.stdin.write("done\n")
                    client.stdin.flush()
            raise AssertionError(
                (seen[-20:], client.stderr.read()[-6000:] if client.poll() is not None else "no result")
            )
        finally:
            if client is not None and client.poll() is None:
                client.kill()
                client.wait()


@pytest.mark.repeat(STRESS)
def test_partition_then_heal_runs_each_cell_once_and_says_so(hosts, tmp_path):
    """nftables drops every packet between client and server (a partition: no reset, no
    close); the client must notice within the heartbeat timeout, come back when the link
    heals, and learn that each cut-off cell ran exactly once."""
    from reliability import record

    result = _run_partitioned(hosts, tmp_path, PARTITION_CLIENT)
    assert sorted(result["runs"]) == ["before", "during"], result["runs"]  # each cell ran, and only once
    for case in ("sent_during", "running_when_cut"):
        r = result[case]
        assert r["detected_s"] < 4.0 + 2.5, r  # heartbeat timeout (4 s) plus a heartbeat period and slack
        assert "whether it ran is reported" in r["message"], r["message"]
        assert r["recovered_s"] is not None and r["state"] == "finished" and r["status"] == "ok", r
        assert "ran " in r["output"] and "ran on the server after all and finished ok" in r["describe"], r
    print(
        "\npartition: "
        + "; ".join(
            f"{k}: lost after {v['detected_s']:.1f} s, back {v['recovered_s']:.1f} s after the heal, "
            f"outcome known after {v['settled_s']:.1f} s"
            for k, v in result.items()
            if k != "runs"
        )
    )
    section = "Network partition (nftables drops all packets between two namespaces, then the link heals)"
    for case, what in (("sent_during", "cell sent while cut"), ("running_when_cut", "cell running when cut")):
        r = result[case]
        record(
            section,
            what,
            f"ConnectionLost after {r['detected_s']:.1f} s; connected again {r['recovered_s']:.1f} s "
            f"after the heal; outcome known {r['settled_s']:.1f} s after it: {r['state']} {r['status']}",
        )
    record(
        section,
        "executions of the two cut-off cells",
        f"{len(result['runs'])} (each ran once: {', '.join(sorted(result['runs']))})",
    )


EXPIRY_CLIENT = textwrap.dedent("""
    import json, sys, time, genie_core
    from genie_core.errors import ConnectionLost

    def step(name):
        print(name, flush=True)
        assert sys.stdin.readline().strip() == "done"

    state = genie_core.init_sync(sys.argv[1], token=sys.argv[2], timeout=20, backend="zmq")
    client = state.client
    client.execute("runs = []").wait(10)
    running = client.execute("import time; time.sleep(60)")
    time.sleep(0.3)
    step("cut")
    queued = client.execute("runs.append('queued')")  # sent into the cut link
    for request in (running, queued):
        try:
            request.wait(60)
        except ConnectionLost:
            pass
    time.sleep(1.0)  # the lease (2 s) has run out on the server's side by now
    step("heal")
    lost = client.lost_requests
    for _ in range(300):  # bounded: 30 s
        if all(r.settled for r in lost.values()):
            break
        time.sleep(0.1)
    out = {
        key: {"state": lost[r.id].state, "describe": lost[r.id].describe()}
        for key, r in (("running", running), ("queued", queued))
    }
    try:
        client.execute("1")
        out["after"] = "no error"
    except ConnectionLost as exc:
        out["after"] = str(exc)
    genie_core.init_sync(sys.argv[1], token=sys.argv[2], timeout=20, backend="zmq")  # %genie_init again
    again = genie_core.get_cluster_state().client
    out["fresh"] = [m.content.get("ename") for m in again.execute("runs").replies(10) if m.type == "error"]
    print("RESULT " + json.dumps(out), flush=True)
    genie_core.shutdown_sync()
""")


@pytest.mark.repeat(STRESS)
def test_a_partition_longer_than_the_lease_ends_the_session_and_says_what_ran(hosts, tmp_path):
    result = _run_partitioned(hosts, tmp_path, EXPIRY_CLIENT, {"GENIE_SESSION_LEASE": "2"})
    assert result["running"]["state"] == "stopped", result["running"]["describe"]
    assert (
        "was running on the server and was stopped part-way when the server ended the session"
        in result["running"]["describe"]
    )
    assert result["queued"]["state"] == "not run", result  # it reached the server after the session ended: refused
    assert "did not run" in result["queued"]["describe"], result
    assert "%genie_init" in result["after"], result["after"]
    assert result["fresh"] == ["NameError"]  # a new session: nothing of the old one, and nothing ran twice
    from reliability import record

    record(
        "Network partition (nftables drops all packets between two namespaces, then the link heals)",
        "partition longer than the session lease (2 s)",
        "the running cell reported stopped part-way, the cell sent into "
        "the cut reported not run; the next request says to run %genie_init, which starts a fresh session",
    )
