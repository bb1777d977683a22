"""The sandbox per session worker (`genie serve --sandbox`), tried the way an attack would be:
two users' sessions on one sandboxed server, and from bob's cells everything that used to reach
alice (her processes, environment, files, her server, the host's services) must fail, while
alice's names survive. Each protection has a test here that fails when it is taken away."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import RunningServer, run, start_server, stdout_of, wait_until, worker_pid

import genie_core
from genie_core.errors import ConfigError, WorkerDied
from genie_core.local_server import start_server_process
from genie_core.nodes import GPUInfo
from genie_core.sandbox import Sandbox, SandboxedWorker, SandboxPolicy, refuse_unisolated
from genie_core.sandbox.policy import UID_BASE

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (scripts/test installs Debian's bubblewrap when root)",
)

MiB = 1 << 20


def cell(client, code: str, timeout: float = 60.0) -> str:
    """Run a cell; its stdout, or AssertionError with its error."""
    replies = run(client, textwrap.dedent(code), timeout=timeout)
    reply = replies[-1][1]
    assert reply["status"] == "ok", f"{reply.get('ename')}: {reply.get('evalue')}"
    return stdout_of(replies)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One sandboxed server, two users on it. The server's connection file and a folder the admin
    hides lie outside /tmp (which cells never see), so that hiding them is what is tested."""
    outside = Path(f"/var/cache/genie-test-{os.urandom(4).hex()}")
    (outside / "hidden").mkdir(parents=True)
    (outside / "hidden" / "admin-secret").write_text("s3cret")
    (outside / "victim").mkdir()  # root's, 0755: a link a cell plants must not lead the server here
    tmp = tmp_path_factory.mktemp("sandbox")
    env = dict(
        os.environ,
        GENIE_TOKEN="test-token-" + os.urandom(8).hex(),
        GENIE_STATE_DIR=str(tmp / "state"),
        GENIE_SANDBOX_HIDE=str(outside / "hidden"),
        SERVER_ONLY_SECRET="the-servers-own",
    )
    args = ("--port", "0", "--sandbox", "--no-ucx", "--session-memory", "512MiB", "--session-processes", "128")
    with open(tmp / "server.log", "w") as log:
        proc, info, line = start_server_process(*args, env=env, connection_file=outside / "server.json", stderr=log)
    srv = RunningServer(proc, info, outside / "server.json", line)
    srv.hidden = outside / "hidden"
    srv.victim = outside / "victim"
    for path in (outside, outside / "hidden"):
        path.chmod(0o755)
    srv.connection_file.chmod(0o644)  # readable by any uid: only the sandbox's mask keeps the token from cells
    try:
        alice, bob = srv.client(timeout=30), srv.client(timeout=30)
        cell(alice, "import os; os.environ['HF_TOKEN'] = 'alice-secret'; names = 41")
        yield srv, alice, bob
        alice.close()
        bob.close()
    finally:
        srv.stop()
        shutil.rmtree(outside, ignore_errors=True)


def _home(client) -> str:
    return cell(client, "import os; print(os.getcwd())").strip()


def _alive(alice) -> None:
    assert cell(alice, "print(names + 1)").strip() == "42", "alice lost her names"


def test_a_cell_sees_signals_and_reads_only_its_own_processes(shared):
    srv, alice, bob = shared
    host_pids = [c.pid for c in __import__("psutil").Process(srv.proc.pid).children(recursive=True)]
    alice_id = cell(alice, "import os; print(os.environ['GENIE_WORKER_ID'])").strip()  # in her /proc/PID/environ
    seen = cell(
        bob,
        f"""
        import os, psutil, signal
        procs = list(psutil.process_iter(["pid", "cmdline", "environ"]))
        print("count", len(procs))
        print("secret", any({alice_id!r} in str(p.info["environ"]) for p in procs))
        print("server-env", "SERVER_ONLY_SECRET" in os.environ or "GENIE_TOKEN" in os.environ)
        for pid in {host_pids}:
            try:
                os.kill(pid, signal.SIGKILL)
                print("killed", pid)
            except (ProcessLookupError, PermissionError):
                pass
        """,
    )
    assert "secret False" in seen and "server-env False" in seen
    assert "killed" not in seen
    assert int(seen.split("count ")[1].split()[0]) <= 3  # its sandbox's init, the worker, maybe a child
    with pytest.raises(WorkerDied):  # an honest `!pkill` ends the cell's own worker, nobody else's
        cell(bob, "import subprocess; subprocess.run(['pkill', '-f', 'genie_core.worker'])")
    _alive(alice)


def test_a_cell_writes_only_its_session_directory_and_sees_no_other(shared, tmp_path):
    srv, alice, bob = shared
    alice_home = _home(alice)
    cell(alice, "open('mine.txt', 'w').write('alice')")
    state = os.environ["GENIE_STATE_DIR"]
    seen = cell(
        bob,
        f"""
        import os
        def attempt(what, f):
            try:
                f()
                print(what, "ok")
            except OSError as e:
                print(what, type(e).__name__)
        attempt("alice-dir", lambda: os.listdir({alice_home!r}))
        attempt("alice-file", lambda: open({alice_home + "/mine.txt"!r}).read())
        attempt("etc", lambda: open("/etc/genie-test", "w"))
        attempt("usr", lambda: open("/usr/genie-test", "w"))
        attempt("own", lambda: open("own.txt", "w").write("bob"))
        attempt("tmp", lambda: open("/tmp/bob.txt", "w").write("bob"))
        print("connection-file", repr(open({str(srv.connection_file)!r}).read()))
        print("hidden", os.listdir({str(srv.hidden)!r}))
        print("state", os.path.isdir({state!r}) and os.listdir({state!r}))
        """,
    )
    assert "alice-dir FileNotFoundError" in seen
    assert "alice-file FileNotFoundError" in seen
    assert "etc OSError" in seen and "usr OSError" in seen  # EROFS
    assert "own ok" in seen and "tmp ok" in seen
    assert "connection-file ''" in seen  # it holds the server's token
    assert "hidden []" in seen  # what the admin hid (--sandbox-hide; the server's state is hidden so)
    assert "state False" in seen or "state []" in seen
    assert not Path("/tmp/bob.txt").exists()  # its /tmp is its own
    _alive(alice)


def test_each_session_runs_as_its_own_uid_without_privileges(shared):
    _srv, alice, bob = shared
    probe = """
        import os
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        caps = [status[k].strip() for k in ("CapEff", "CapBnd", "NoNewPrivs")]
        print(os.getuid(), os.getgid(), *caps)
    """
    a, b = (cell(c, probe).split() for c in (alice, bob))
    assert a[0] != b[0]
    for uid, gid, eff, bounding, nnp in (a, b):
        assert int(uid) >= UID_BASE and gid == uid
        assert int(eff, 16) == 0 and int(bounding, 16) == 0 and nnp == "1"


def test_outbound_network_reaches_nothing_on_this_host(shared):
    srv, _alice, bob = shared
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        ports = [srv.info.port, listener.getsockname()[1]]
        seen = cell(
            bob,
            f"""
            import socket
            for port in {ports}:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=3).close()
                    print(port, "connected")
                except OSError as e:
                    print(port, type(e).__name__)
            """,
        )
    finally:
        listener.close()
    assert "connected" not in seen, seen
    socket.create_connection(("127.0.0.1", srv.info.port), timeout=3).close()  # the host itself still can


def test_a_fork_bomb_stops_at_the_sessions_process_limit(shared):
    _srv, alice, bob = shared
    seen = cell(
        bob,
        """
        import subprocess
        started = []
        try:
            for _ in range(300):
                started.append(subprocess.Popen(["sleep", "30"]))
        except OSError as e:
            print("stopped at", len(started), type(e).__name__)
        for p in started:
            p.kill()
            p.wait()
        """,
    )
    assert "stopped at" in seen
    assert int(seen.split("stopped at ")[1].split()[0]) < 128
    _alive(alice)


def test_a_memory_hog_ends_in_its_own_session_with_one_clear_line(shared):
    _srv, alice, bob = shared
    with pytest.raises(WorkerDied, match=r"went over its memory limit, 512(\.0)? MiB \(--session-memory\)"):
        cell(bob, "hog = bytearray(900 << 20)", timeout=60)
    _alive(alice)
    assert cell(bob, "print('fresh')").strip() == "fresh"  # bob's next cell gets a fresh worker


def test_shared_memory_moves_through_the_private_dev_shm(shared, monkeypatch):
    """A push's segment is renamed into the worker's own /dev/shm, a pull's out of it: no copy. A
    lent upload segment (a GPU server's) goes in once and is filled again, its name gone."""
    srv, _alice, _bob = shared
    state = genie_core.init_sync(f"127.0.0.1:{srv.info.port}", token=srv.info.token, backend="shm", timeout=30)
    try:
        client = state.client
        assert client.channel.name == "shm"
        x = torch.arange(16 * MiB, dtype=torch.float32)
        client.push({"x": x})
        client.execute("y = x * 2").wait(30)
        back = client.pull(["x", "y"])
        assert torch.equal(back["x"], x) and torch.equal(back["y"], x * 2)
        monkeypatch.setenv("GENIE_UPLOAD_SEGMENTS", "lent")
        lent = client.transfers.channel.lent_segments(0)
        for i in range(3):
            assert torch.equal((x[:MiB] + i).to("remote_accelerator:0").cpu(), x[:MiB] + i)
        assert lent.made == 1
        private = [p.name for p in Path("/dev/shm").glob(f"genie-sbx-{srv.proc.pid}-*/genie-*")]
        assert all(name.startswith("genie-w-") for name in private), private  # only the worker's spares
    finally:
        genie_core.shutdown_sync()


def test_a_download_over_a_data_port_leaves_no_segment_behind(shared):
    """Over tcp a sandboxed worker replies before it fills its segment; the server moves that out
    of the sandbox meanwhile and the data port removes it as it sends it. The bytes arrive whole,
    and the worker keeps no mapping of it after (its memory counts against the session)."""
    srv, _alice, _bob = shared
    state = genie_core.init_sync(f"127.0.0.1:{srv.info.port}", token=srv.info.token, backend="tcp", timeout=30)
    try:
        client = state.client
        x = torch.arange(16 * MiB, dtype=torch.float32)  # 64 MiB
        client.push({"x": x})
        for i in range(2):
            client.execute(f"y = x + {i}").wait(30)
            assert torch.equal(client.pull(["y"])["y"], x + i)
        pid = worker_pid(client)
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()  # (a segment moved out reads "/ (deleted)")
        held = [line for line in maps if " rw-s " in line and line.endswith("(deleted)") and "genie-s-" not in line]
        assert held == []  # only x's segment, the push's
        assert list(Path("/dev/shm").glob(f"genie-w-{pid}-*")) == []
    finally:
        genie_core.shutdown_sync()


def test_a_sandboxed_session_does_what_it_did_without(shared, tmp_path):
    """What a cell could do before, it can in the sandbox: remote tensors, interrupts, jobs,
    synced modules, uploads and downloads, rich display, `!cmd`. (The cell, tensor, jobs, sync,
    files and interrupt suites also pass whole with GENIE_SANDBOX=1: see the README.)"""
    srv, _alice, _bob = shared
    state = genie_core.init_sync(f"127.0.0.1:{srv.info.port}", token=srv.info.token, timeout=30)
    try:
        client = state.client
        x = torch.randn(64, 64, device="remote_accelerator:0")
        assert torch.allclose((x @ x).cpu(), x.cpu() @ x.cpu(), atol=1e-4)
        running = client.execute("import time\ntime.sleep(30)")
        time.sleep(0.5)
        client.interrupt()
        assert any(m.type == "error" and m.content["ename"] == "KeyboardInterrupt" for m in running.replies(10))
        job = client.start_job("print('from a job')")
        assert job.wait(30) and "from a job" in job.output()
        (tmp_path / "project").mkdir()
        (tmp_path / "project" / "helper.py").write_text("def twice(n):\n    return 2 * n\n")
        client.sync(tmp_path / "project")
        (tmp_path / "data.bin").write_bytes(os.urandom(3 * MiB))
        client.upload(tmp_path / "data.bin", "data.bin")
        out = cell(
            client,
            """
            import helper, subprocess
            from IPython.display import display, HTML
            display(HTML("<b>rich</b>"))
            open("made.txt", "w").write(str(helper.twice(21)))
            print(subprocess.run("echo from a shell", shell=True, capture_output=True, text=True).stdout)
            """,
        )
        assert "from a shell" in out
        client.download("made.txt", tmp_path / "made.txt")
        client.download("data.bin", tmp_path / "back.bin")
        assert (tmp_path / "made.txt").read_text() == "42"
        assert (tmp_path / "back.bin").read_bytes() == (tmp_path / "data.bin").read_bytes()
    finally:
        genie_core.shutdown_sync()


def test_only_the_sessions_gpu_device_nodes(tmp_path):
    """This machine has no GPU: the device nodes are stand-in files (labelled fake), bound the
    way real /dev/nvidiaN nodes are."""
    fake_dev = tmp_path / "fake-dev"
    fake_dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (fake_dev / name).write_text("fake device node")
    sandbox = Sandbox(SandboxPolicy(network="none"), dev=fake_dev)
    worker = SandboxedWorker(sandbox, "gpu-test", tmp_path / "home", None, GPUInfo(1, uuid="GPU-fake-1"))
    try:
        argv, env = worker.command(["sh", "-c", "ls /dev; echo cvd=$CUDA_VISIBLE_DEVICES"], {"GENIE_WORKER_ID": "x"})
        env["PATH"] = os.environ["PATH"]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30).stdout.split()
    finally:
        worker.close()
        sandbox.stop()
    assert {"nvidia1", "nvidiactl", "nvidia-uvm"} <= set(out)
    assert "nvidia0" not in out and "nvidia2" not in out
    assert "kmsg" not in out and "loop0" not in out  # none of the host's other devices
    assert "cvd=GPU-fake-1" in out


def test_a_server_without_a_protection_refuses_to_start_unless_allowed(tmp_path):
    no_bwrap = {"PATH": "/nonexistent"}
    with pytest.raises(Exception, match="did not start"):
        start_server(tmp_path, "--sandbox", "--no-ucx", env=no_bwrap)
    srv = start_server(tmp_path, "--sandbox", "--allow-unisolated", "--no-ucx", env=no_bwrap)
    try:
        c = srv.client()
        assert cell(c, "print(1)").strip() == "1"
        c.close()
    finally:
        srv.stop()
    logs = "".join(log.read_text() for log in tmp_path.glob("*.log"))
    assert "the sandbox cannot give every protection here" in logs and "bubblewrap is not installed" in logs


def test_a_pool_refuses_to_start_where_a_protection_is_missing_unless_allowed(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no bubblewrap
    with pytest.raises(ConfigError, match="bubblewrap is not installed"):
        refuse_unisolated({"sandbox": True})
    allowed = refuse_unisolated({"sandbox": True, "allow_unisolated": True})
    assert not next(p for p in allowed if p.name == "processes and files").on
    monkeypatch.undo()
    assert all(p.on for p in refuse_unisolated({"sandbox": True}))  # this machine gives them all


def test_a_link_a_cell_plants_does_not_lead_the_server_elsewhere(shared, tmp_path):
    """%genie_sync writes a sandboxed session's directory as the session's uid: through a link a
    cell planted there, root's folder stays untouched."""
    srv, _alice, bob = shared
    cell(bob, f"import os; os.symlink({str(srv.victim)!r}, 'planted')")
    (tmp_path / "project" / "planted").mkdir(parents=True)
    (tmp_path / "project" / "planted" / "evil.py").write_text("x = 1\n")
    with pytest.raises(Exception, match="Permission denied"):
        bob.sync(tmp_path / "project")
    assert not (srv.victim / "evil.py").exists()
    assert cell(bob, "print(open('own.txt', 'w').write('still mine'))").strip() == "10"


def test_segments_that_are_links_are_refused_both_ways(tmp_path):
    """A segment name is a rename on /dev/shm: a link in its place (planted by a cell in its own
    /dev/shm, or by another local user in the host's) is refused, never followed by root."""
    target = tmp_path / "root-only"
    target.write_text("top secret")
    target.chmod(0o600)
    sandbox = Sandbox(SandboxPolicy(network="none"))
    worker = SandboxedWorker(sandbox, f"link-{os.getpid()}", tmp_path / "home", UID_BASE + 7, None)
    planted = Path("/dev/shm") / f"genie-c-{os.getpid()}-link"
    try:
        (worker.shm / "genie-w-2-planted").symlink_to(target)
        assert worker.move_out("genie-w-2-planted", 12345) == ""
        planted.symlink_to(target)
        worker.move_in(planted.name)
        assert not (worker.shm / planted.name).exists()
        assert target.stat().st_uid == 0 and target.read_text() == "top secret"
        real = Path("/dev/shm") / f"genie-c-{os.getpid()}-real"
        real.write_bytes(b"data")
        worker.move_in(real.name)
        assert (worker.shm / real.name).stat().st_uid == UID_BASE + 7  # a plain segment goes in
        out = worker.move_out(real.name, 12345)
        assert out.startswith("genie-w-12345-") and (Path("/dev/shm") / out).stat().st_uid == 0
        (Path("/dev/shm") / out).unlink()
    finally:
        planted.unlink(missing_ok=True)
        worker.close()
        sandbox.stop()


def test_a_sandboxed_worker_ends_with_its_killed_server(tmp_path):
    """SIGKILL to the server (Ray kills a session actor's process so): its sandboxed workers end
    too, with their cells' children, and hold no GPU or memory (bubblewrap's own
    --die-with-parent does not survive the worker's change of uid)."""
    srv = start_server(tmp_path, "--sandbox", "--no-ucx")
    try:
        c = srv.client(timeout=30)
        child = int(cell(c, "import subprocess; print(subprocess.Popen(['sleep', '600']).pid)"))
        pid = worker_pid(c)
        host_children = [p.pid for p in psutil.Process(pid).children(recursive=True)]
        assert host_children, f"no child of the worker on the host (its sleep was pid {child} inside)"
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        for p in [pid, *host_children]:
            assert wait_until(lambda p=p: not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie", 10), (
                f"process {p} outlived its killed server"
            )
        c.close(notify=False)
    finally:
        srv.stop()
