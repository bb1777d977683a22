"""No orphans: a server's workers (and their own children) end when the server ends, however it
ends, and an embedded server ends with its kernel. On a GPU machine an orphaned worker would
hold its GPU memory until someone found and killed it."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from conftest import STRESS, run, start_server, stdout_of, wait_until
from jupyter_client.manager import start_new_kernel
from reliability import record

HOLD = (
    "import os, subprocess, torch\n"
    "held = torch.ones(64 << 20)\n"
    "child = subprocess.Popen(['sleep', '600'])\n"
    "print(os.getpid(), child.pid)"
)
# One C call that never lets go of the GIL (no thread of the worker's own can run meanwhile)
HOLD_THE_GIL = "import time\nprint('holding', flush=True)\ntime.sleep(0.5)\nsum(range(1 << 62))"


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie (whose memory the kernel has already taken back)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _end(pids: list[int]) -> None:
    """What a failed test leaves (a worker spinning with the GIL held would slow every later test)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _workers_of(server_pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(server_pid).children() if "genie_core.worker" in " ".join(p.cmdline())]


@pytest.mark.repeat(STRESS)
def test_a_sigkilled_server_leaves_no_worker_behind(tmp_path):
    """Each worker has a lifeline of its own: the session's worker (started before the spare)
    ends at once even while it holds the GIL, so that no check of its own could run."""
    srv = start_server(tmp_path)
    client = srv.client()
    everyone: list[int] = []
    try:
        worker, child = map(int, stdout_of(run(client, HOLD)).split())
        assert psutil.Process(worker).memory_info().rss > 256 << 20
        workers = _workers_of(srv.proc.pid)  # the session's worker and the warm spare
        everyone = [*workers, child]
        assert worker in workers and len(workers) >= 2
        holding = client.execute(HOLD_THE_GIL)
        assert any(m.type == "stream" for m in holding.replies(10))  # (stops at the first message)
        time.sleep(1.0)  # its output is out (its output thread cannot run once the GIL is held)
        srv.proc.kill()
        killed = time.monotonic()
        assert wait_until(lambda: all(_gone(p) for p in everyone), timeout=2.0), [p for p in everyone if not _gone(p)]
        took = time.monotonic() - killed
        record(
            "No orphans",
            "server SIGKILLed, its session holding 256 MiB and a child process",
            f"{len(workers)} workers and the cell's child ended {took:.3f} s later",
        )
    finally:
        client.close(notify=False)
        srv.stop()
        _end(everyone)


@pytest.mark.repeat(STRESS)
def test_a_worker_that_ignores_sigio_still_ends_with_its_server(tmp_path):
    """User code can ignore the lifeline's signal; the worker's own check of its parent remains."""
    srv = start_server(tmp_path)
    client = srv.client()
    try:
        worker = int(
            stdout_of(run(client, "import os, signal\nsignal.signal(signal.SIGIO, signal.SIG_IGN)\nprint(os.getpid())"))
        )
        srv.proc.kill()
        assert wait_until(lambda: _gone(worker), timeout=3.0)  # its own check of its parent, once a second
    finally:
        client.close(notify=False)
        srv.stop()


@pytest.mark.repeat(STRESS)
def test_the_start_up_sweep_ends_workers_whose_server_is_gone(tmp_path):
    """A worker of a dead server that ignores SIGIO and whose own checks cannot run (stopped):
    the next server's start-up sweep ends it."""
    srv = start_server(tmp_path)
    client = srv.client()
    try:
        worker = int(
            stdout_of(run(client, "import os, signal\nsignal.signal(signal.SIGIO, signal.SIG_IGN)\nprint(os.getpid())"))
        )
        os.kill(worker, signal.SIGSTOP)  # no thread of it can run: only someone else can end it
        srv.proc.kill()
        time.sleep(0.5)
        assert not _gone(worker)
        # A server of another runtime folder (another installation, another test process) leaves it
        elsewhere = start_server(tmp_path, env={"GENIE_RUNTIME_DIR": str(tmp_path / "elsewhere")})
        elsewhere.stop()
        assert not _gone(worker)
        nxt = start_server(tmp_path)
        try:
            assert wait_until(lambda: _gone(worker), timeout=2.0)
        finally:
            nxt.stop()
    finally:
        client.close(notify=False)
        srv.stop()
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.repeat(STRESS)
def test_a_sigkilled_kernel_takes_its_embedded_server_and_workers_along(tmp_path):
    """The kernel alone SIGKILLed, as the OOM killer does, after it forked a process that
    outlives it (user code's os.fork, multiprocessing's): that copy of the kernel does not keep
    the server's lifeline open."""
    km, kc = start_new_kernel(kernel_name="python3")
    everyone: list[int] = []
    forked = 0
    try:
        from test_kernel import execute, stdout

        execute(kc, "%load_ext genie_jupyter")
        reply, msgs = execute(kc, "%genie_init")
        assert reply["status"] == "ok", msgs
        reply, msgs = execute(kc, "%%remote\n" + HOLD)
        worker, child = map(int, stdout(msgs).split())
        server = psutil.Process(worker).parent()
        assert "genie_core" in " ".join(server.cmdline())
        everyone = [server.pid, *_workers_of(server.pid), child]
        reply, msgs = execute(
            kc, "import os, time\nforked = os.fork()\nif not forked: time.sleep(60); os._exit(0)\nprint(forked)"
        )
        forked = int(stdout(msgs))
        kernel = server.parent()
        assert forked in [p.pid for p in kernel.children()]
        os.kill(kernel.pid, signal.SIGKILL)  # not its process group, which the fork is in
        killed = time.monotonic()
        assert wait_until(lambda: all(_gone(p) for p in everyone), timeout=2.0), [p for p in everyone if not _gone(p)]
        took = time.monotonic() - killed
        record(
            "No orphans",
            "kernel SIGKILLed with an embedded server whose session held 256 MiB",
            f"server, {len(everyone) - 2} workers and the cell's child ended {took:.3f} s later",
        )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        _end([*everyone, forked] if forked else everyone)  # (pid 0 would be this process group)


def test_a_sandboxed_worker_whose_wrapper_outlived_its_server_still_ends(tmp_path):
    """bubblewrap's --die-with-parent misses a server that dies while bubblewrap starts (it sets
    its parent-death signal after it runs; two sandboxed workers outlived a test run so). The
    worker reads the lifeline itself, once a second. Here `unshare` stands for the wrapper that
    stayed: a PID namespace of the worker's own, its process group outside it, as in the sandbox."""
    import subprocess
    import sys

    from genie_core.lifeline import Lifeline

    lifeline = Lifeline()
    argv = [sys.executable, "-m", "genie_core.worker", f"ipc://{tmp_path}/workers", "w-orphan", str(lifeline.fd), "1"]
    # as bubblewrap does, an init of the namespace's own (pid 1) runs the worker
    command = ["unshare", "--pid", "--fork", "sh", "-c", f"{' '.join(argv)}; true"]
    wrapper = subprocess.Popen(command, pass_fds=(lifeline.fd,), start_new_session=True)
    worker = None

    def python_worker() -> int | None:  # (not the sh -c that names it in its command line)
        found = [p.pid for p in psutil.Process(wrapper.pid).children(True) if "genie_core.worker" in p.cmdline()]
        return found[0] if found else None

    try:
        assert wait_until(lambda: python_worker() is not None, timeout=10)
        worker = python_worker()
        assert worker is not None
        time.sleep(2.0)  # the worker is up (its checks run), its server (this test) still here
        assert not _gone(worker)
        lifeline.close()  # the server ends; the wrapper stays
        assert wait_until(lambda: _gone(worker), timeout=5.0)
    finally:
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
        wrapper.wait(5)


def test_a_lifeline_says_gone_only_when_its_parent_end_closed():
    from genie_core.lifeline import Lifeline, parent_gone

    lifeline = Lifeline()
    assert not parent_gone(lifeline.fd)
    os.close(lifeline._write_end)
    assert parent_gone(lifeline.fd)
    os.close(lifeline.fd)
    assert not parent_gone(lifeline.fd)  # not open here (a sandbox without it): says nothing


def test_workers_end_first_when_a_gpu_reading_hangs_at_stop(tmp_path, caplog):
    """A server stopping while its monitor is stuck in a GPU reading (a hung NVML call, a
    loaded host): its workers, which hold the GPUs' memory, end first and at once, the stop is
    not held up past the monitor's bound, and the GPU source is not closed under the call."""
    import threading

    from genie_core.client import Client
    from genie_core.config import ClusterConfig
    from genie_core.monitoring import StaticGPUSource
    from genie_core.server import Server

    entered, release = threading.Event(), threading.Event()
    hang = {"on": False}

    def readings():
        if hang["on"]:
            entered.set()
            release.wait(30)
        return []

    class Source(StaticGPUSource):  # a labelled fake at the hardware edge
        closed_under_a_read = False

        def close(self) -> None:
            Source.closed_under_a_read = entered.is_set() and not release.is_set()

    config = ClusterConfig.resolve(
        node_role="server", master_port=0, token="t", gpu_poll_interval=0.1, state_dir=str(tmp_path)
    )
    server = Server(config, gpu_source=Source(readings), spare_workers=0).start().start_in_thread()
    client = Client("127.0.0.1", server.port, "t", timeout=10).connect()
    try:
        worker = int(stdout_of(run(client, "import os\nprint(os.getpid())")))
        hang["on"] = True
        assert entered.wait(5)
        stopping = threading.Thread(target=server.stop)
        asked = time.monotonic()
        stopping.start()
        assert wait_until(lambda: _gone(worker), timeout=0.8), "the worker outlived the GPU reading"
        stopping.join(10)
        stopped = time.monotonic() - asked
        assert stopped < 3.0, f"the stop took {stopped:.1f} s"
        assert not Source.closed_under_a_read
        release.set()  # the poll ends and writes its reading: into a history file still open
        monitor = server.telemetry.monitor
        assert monitor is not None and monitor._thread is not None
        monitor._thread.join(5)
        assert not [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    finally:
        release.set()
        client.close(notify=False)
        server.stop()
