"""Named sessions against a real server and real kernels: they outlive their kernel (killed or
restarted), a later `%genie_init --session NAME` attaches with namespace and jobs intact, a
second client takes over and the first is told, and idle ones end after a warning."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import run, start_server, stdout_of, wait_until
from jupyter_client.manager import start_new_kernel
from test_kernel import execute, init_summary, stdout

from genie_core.errors import ConnectionFailed, ConnectionLost


def steps(go) -> str:
    """A job that waits (at most 60 s) for the test to create the file `go`, then prints 30 steps:
    still running when a new kernel reattaches, however long the machine takes to start one."""
    wait = f"import os, time\nfor _ in range(600):\n    if os.path.exists({str(go)!r}):\n        break\n"
    wait += "    time.sleep(0.1)\n"
    return wait + "for i in range(30):\n    print('step', i, flush=True)\n"


@pytest.fixture
def srv(tmp_path):
    server = start_server(tmp_path, env={"GENIE_SESSION_LEASE": "2"})
    yield server
    server.stop()


def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    assert execute(kc, "%load_ext genie_jupyter")[0]["status"] == "ok"
    return km, kc


def init_line(srv, name: str) -> str:
    return f"%genie_init 127.0.0.1:{srv.info.port} --token {srv.info.token} --session {name}"


def test_a_job_survives_its_kernel_being_killed_and_a_new_kernel_reattaches(srv, tmp_path):
    go = tmp_path / "go"
    km, kc = kernel()
    try:
        reply, msgs = execute(kc, init_line(srv, "work"))
        assert reply["status"] == "ok" and "new session 'work'" in init_summary(msgs)
        assert execute(kc, "%%remote\nx = 'made in the first kernel'")[0]["status"] == "ok"
        reply, msgs = execute(kc, "%%remote --bg --name train\n" + steps(go))
        assert reply["status"] == "ok" and "started background job 'train'" in stdout(msgs)
        time.sleep(0.5)
        km.signal_kernel(signal.SIGKILL)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    km, kc = kernel()
    try:
        reply, msgs = execute(kc, init_line(srv, "work"))
        assert reply["status"] == "ok", msgs
        text = init_summary(msgs)
        assert "reattached to session 'work'" in text and "1 job running" in text, text
        go.touch()  # the job goes on (a cell waits for it: they share the session's worker)
        reply, msgs = execute(kc, "%remote print(x)")
        assert reply["status"] == "ok" and stdout(msgs) == "made in the first kernel\n"
        reply, msgs = execute(
            kc, "job = %genie_jobs train\nprint(job.wait(30), job.state)\nprint(job.output(), end='')"
        )
        assert reply["status"] == "ok", msgs
        assert stdout(msgs) == "True ok\n" + "".join(f"step {i}\n" for i in range(30))
    finally:
        execute(kc, "%genie_shutdown")
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_kernel_restart_leaves_a_named_session_running(srv):
    km, kc = kernel()
    try:
        execute(kc, init_line(srv, "kept"))
        execute(kc, "%%remote\nimport torch\nweights = torch.arange(6.0)")
        km.restart_kernel()  # a clean exit: the kernel detaches instead of ending the session
        kc.wait_for_ready(timeout=60)
        execute(kc, "%load_ext genie_jupyter")
        _, msgs = execute(kc, init_line(srv, "kept"))
        assert "reattached to session 'kept'" in init_summary(msgs)
        reply, msgs = execute(kc, "%remote print(weights.sum().item())")
        assert reply["status"] == "ok" and stdout(msgs) == "15.0\n", msgs
    finally:
        execute(kc, "%genie_shutdown")
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_second_client_takes_the_session_over_and_the_first_is_told(srv):
    first = srv.client(session_name="shared")
    run(first, "names = ['from the first']")
    second = srv.client(session_name="shared")
    try:
        assert second.attached and second.session == first.session
        assert stdout_of(run(second, "names.append('second'); print(names)")) == "['from the first', 'second']\n"
        with pytest.raises(ConnectionLost, match="session 'shared' was attached by another client"):
            run(first, "print('the first again')")
    finally:
        first.close(notify=False)
        second.close()


def test_without_a_name_nothing_is_shared(srv):
    first = srv.client()
    second = srv.client()
    try:
        assert not second.attached and second.session != first.session
    finally:
        first.close()
        second.close()


def test_shutdown_ends_a_named_session_and_the_name_starts_afresh(srv):
    first = srv.client(session_name="once")
    run(first, "y = 1")
    first.close()  # %genie_shutdown
    again = srv.client(session_name="once")
    try:
        assert not again.attached
        assert "NameError" in str(run(again, "print(y)"))
    finally:
        again.close()


def test_an_idle_named_session_ends_after_a_warning_and_a_busy_one_never(tmp_path):
    server = start_server(tmp_path, "--idle-timeout", "2", env={"GENIE_SESSION_LEASE": "1.5"})
    watcher = server.client(heartbeat_interval=0.2, heartbeat_timeout=1.0)  # well within its own lease
    try:
        owner = server.client(session_name="idle")
        owner.start_job("import time\ntime.sleep(6)", name="keeps-it-busy")
        owner.close(notify=False)  # the client goes; the job keeps the session busy

        def names() -> list[str]:
            return [s["name"] for s in watcher.info()["sessions"]]

        time.sleep(5)  # lease (1.5 s) + idle timeout (2 s) passed, but the job still runs
        assert "idle" in names()
        assert wait_until(lambda: "idle" not in names(), 15)
        events = [(e["type"], e["data"]["message"]) for e in watcher.info(events=50)["events"]]
        mine = [(t, m) for t, m in events if "'idle'" in m or "idle: no client" in m]
        kinds = [t for t, _ in mine]
        assert "SESSION_DETACHED" in kinds and "SESSION_IDLE" in kinds, mine
        assert kinds.index("SESSION_IDLE") < len(kinds) - 1 and kinds[-1] == "SESSION_CLOSED", mine
    finally:
        watcher.close()
        server.stop()


def test_another_users_client_cannot_take_a_live_named_session(srv, monkeypatch):
    """Two people who both pick "train" do not end up sharing a namespace."""
    first = srv.client(session_name="train")
    try:
        monkeypatch.setenv("USER", "someone-else")
        with pytest.raises(ConnectionFailed, match=r"session 'train' is in use by .*pick another --session name"):
            srv.client(session_name="train")
        monkeypatch.undo()
        assert stdout_of(run(first, "print('untouched')")) == "untouched\n"
    finally:
        first.close()


def test_a_running_cell_keeps_a_detached_session_from_being_culled(tmp_path):
    """Not only jobs: a plain cell still running when its client went counts as busy."""
    server = start_server(tmp_path, "--idle-timeout", "2", env={"GENIE_SESSION_LEASE": "1.5"})
    watcher = server.client(heartbeat_interval=0.2, heartbeat_timeout=1.0)
    try:
        owner = server.client(session_name="cell")
        owner.execute("import time\ntime.sleep(6)")
        owner.close(notify=False)
        time.sleep(5)  # past the lease and the idle timeout, the cell still running
        assert "cell" in [s["name"] for s in watcher.info()["sessions"]]
    finally:
        watcher.close()
        server.stop()
