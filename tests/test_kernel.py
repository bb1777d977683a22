"""The magics in a real Jupyter kernel (jupyter_client): what a notebook user sees on IOPub."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import STRESS, plain
from jupyter_client.manager import start_new_kernel


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    yield km, kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def execute(kc, code: str, timeout: float = 60.0) -> tuple[dict, list[tuple[float, dict]]]:
    """Run code; return the execute_reply content and the IOPub messages with arrival times.

    A cell that ipykernel aborted is sent again (at most 20 times): ipykernel aborts the execute
    requests that reach it before it has finished aborting its queue after an error, and one sent
    as the error's reply arrives can be among them (status "aborted": it never ran)."""
    for _ in range(20):
        reply, messages = _execute_once(kc, code, timeout)
        if reply["status"] != "aborted":
            break
        time.sleep(0.1)
    return reply, messages


def _execute_once(kc, code: str, timeout: float) -> tuple[dict, list[tuple[float, dict]]]:
    msg_id = kc.execute(code)
    messages: list[tuple[float, dict]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=deadline - time.monotonic())
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
        messages.append((time.monotonic(), msg))
    return reply_to(kc, msg_id)["content"], messages


def reply_to(kc, msg_id: str, timeout: float = 10.0) -> dict:
    """The shell reply to `msg_id` (replies to earlier requests, already handled, are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = kc.get_shell_msg(timeout=max(deadline - time.monotonic(), 0.01))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


def stdout(messages) -> str:
    return "".join(
        m["content"]["text"] for _, m in messages if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
    )


def init_summary(messages) -> str:
    """The text of %genie_init's widget once its summary is in (the update of its display)."""
    updates = [m["content"]["data"] for _, m in messages if m["msg_type"] == "update_display_data"]
    assert updates and "application/vnd.jupyter.widget-view+json" in updates[-1], messages
    return updates[-1]["text/plain"]


@pytest.fixture(scope="module")
def connected(kernel, tmp_path_factory):
    from conftest import start_server

    srv = start_server(tmp_path_factory.mktemp("kernel-server"))
    km, kc = kernel
    reply, _ = execute(kc, "%load_ext genie_jupyter")
    assert reply["status"] == "ok"
    reply, msgs = execute(kc, f"%genie_init 127.0.0.1:{srv.info.port} --token {srv.info.token}")
    assert reply["status"] == "ok", msgs
    # The summary is said once: in the init widget (its text snapshot updated in place), not printed beside it.
    assert "Connected to" not in stdout(msgs)
    assert "Connected to genie server" in init_summary(msgs), msgs
    yield km, kc
    execute(kc, "%genie_shutdown")
    srv.stop()


def test_output_streams_live(connected):
    _, kc = connected
    reply, msgs = execute(kc, "%%remote\nimport time\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('second')")
    assert reply["status"] == "ok"
    times = {m["content"]["text"].strip(): t for t, m in msgs if m["msg_type"] == "stream"}
    assert times["second"] - times["first"] > 1.0


def test_rich_output_and_figures(connected):
    _, kc = connected
    reply, msgs = execute(
        kc,
        "%%remote\nfrom IPython.display import HTML, display\ndisplay(HTML('<i>rich</i>'))\n"
        "import matplotlib.pyplot as plt\nplt.plot([3, 1, 2])\nplt.show()",
    )
    assert reply["status"] == "ok"
    data = [m["content"]["data"] for _, m in msgs if m["msg_type"] == "display_data"]
    assert any(d.get("text/html") == "<i>rich</i>" for d in data)
    assert any("image/png" in d for d in data)


def test_remote_traceback_is_shown_and_the_cell_fails(connected):
    _, kc = connected
    reply, msgs = execute(kc, "%%remote\ndef inner():\n    raise KeyError('missing-key')\ninner()")
    assert reply["status"] == "error"
    errors = [m["content"] for _, m in msgs if m["msg_type"] == "error"]
    text = plain("\n".join(errors[0]["traceback"]))
    assert "raise KeyError('missing-key')" in text and "KeyError" in text
    assert "genie_jupyter" not in text and "magics.py" not in text


@pytest.mark.repeat(STRESS)
def test_interrupt_button_interrupts_the_remote_cell(connected):
    km, kc = connected
    execute(kc, "%remote survivor = 'still here'")
    msg_id = kc.execute("%%remote\nimport time\ntime.sleep(60)")
    time.sleep(1.0)
    start = time.monotonic()
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=10)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert time.monotonic() - start < 5  # (the cell sleeps 60 s) about 0.2 s idle; 1.8 s seen in a loaded suite
    assert reply["content"]["status"] == "error"
    assert "KeyboardInterrupt" in plain("\n".join(reply["content"]["traceback"]))
    while True:  # drain this cell's IOPub
        msg = kc.get_iopub_msg(timeout=5)
        if msg["parent_header"].get("msg_id") == msg_id and msg["content"].get("execution_state") == "idle":
            break
    reply, msgs = execute(kc, "%%remote\nprint(survivor)")
    assert reply["status"] == "ok" and stdout(msgs) == "still here\n"


def test_autoremote_runs_every_cell_remotely_until_turned_off(connected):
    _, kc = connected
    execute(kc, "import os\nlocal_pid = os.getpid()")
    reply, msgs = execute(kc, "%autoremote on")
    assert reply["status"] == "ok" and "autoremote on: every cell now runs on genie://" in stdout(msgs)
    reply, msgs = execute(kc, "import os\nremote_pid = os.getpid()\nprint(remote_pid)")
    assert reply["status"] == "ok", msgs
    remote_pid = int(stdout(msgs))
    reply, msgs = execute(kc, "def f():\n    return 1 / 0\nf()")
    assert reply["status"] == "error"
    traceback = plain("\n".join(next(m["content"]["traceback"] for _, m in msgs if m["msg_type"] == "error")))
    assert "return 1 / 0" in traceback and "ZeroDivisionError" in traceback
    reply, msgs = execute(kc, "%genie_jobs --text")  # Genie's own magics stay local
    assert reply["status"] == "ok" and "background jobs" in stdout(msgs).lower()
    reply, msgs = execute(kc, "%autoremote off")
    assert "autoremote off" in stdout(msgs)
    reply, msgs = execute(kc, f"print(os.getpid() == local_pid, os.getpid() != {remote_pid}, 'remote_pid' in dir())")
    assert stdout(msgs) == "True True False\n", msgs


def test_autoremote_refuses_anything_but_on_or_off(connected):
    _, kc = connected
    reply, msgs = execute(kc, "%autoremote maybe")
    assert reply["status"] == "error" and "takes on or off" in str(msgs)


def test_status_text_is_plain_text_with_no_line_cut(connected):
    """rich would draw for Jupyter at 115 columns, wrapping the data-plane line and squeezing tables;
    the text report is printed whole and the notebook wraps it at the window's width."""
    _, kc = connected
    reply, msgs = execute(kc, "%genie_status --text")
    assert reply["status"] == "ok" and not [m for _, m in msgs if m["msg_type"] == "display_data"]
    lines = stdout(msgs).splitlines()
    plane = next(line for line in lines if line.startswith("data plane offers"))
    assert plane.rstrip().endswith(")") and "gpudirect" in plane, plane
    assert not any("…" in line for line in lines), lines


def _error_line(msgs) -> str:
    errors = [m["content"] for _, m in msgs if m["msg_type"] == "error"]
    assert errors, msgs
    return plain("\n".join(errors[0]["traceback"]))


def _value(kc, expression: str) -> str:
    """An expression's value in the kernel, as its text (a string without its quotes)."""
    _, msgs = execute(kc, expression)
    shown = [m["content"]["data"]["text/plain"] for _, m in msgs if m["msg_type"] == "execute_result"]
    assert shown, msgs
    return shown[0].strip("'")


def _black_hole():
    """A TCP port that accepts and never answers: a genie init to it waits until cancelled."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener


def test_a_failed_or_cancelled_init_leaves_the_session_and_its_names(connected):
    """A second %genie_init that fails (wrong token, nobody listening, another Python on the
    server) or is interrupted replaces nothing: the error says so, and the next cell still runs in
    the same session with its variables."""
    km, kc = connected
    execute(kc, "%remote kept = 'my names'")
    execute(kc, "import genie_core\nbefore = genie_core.get_cluster_state().client.session")
    session = _value(kc, "before[:8]")
    port = int(_value(kc, "genie_core.get_cluster_state().address").rsplit(":", 1)[1])
    closed = _black_hole()
    free_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    pretend_other_python = (
        "import genie_core.versions as v\n_real = v._versions\n"
        "v._versions = lambda: {**_real(), 'python': '3.99.0'}\n"
        "_token = genie_core.get_cluster_state().config.token\n"
    )
    attempts = [
        (f"%genie_init 127.0.0.1:{port} --token wrong-token-0123456789", "AuthenticationError"),
        (f"%genie_init 127.0.0.1:{free_port} --token some-token-0123456789 --timeout 2", "ConnectionFailed"),
        (pretend_other_python + f"%genie_init 127.0.0.1:{port} --token {{_token}}", "VersionMismatch"),
    ]
    for cell, error in attempts:
        reply, msgs = execute(kc, cell)
        execute(kc, "if '_real' in dir(): v._versions = _real")
        assert reply["status"] == "error", (cell, msgs)
        line = _error_line(msgs)
        assert line.startswith(error), line
        assert f"nothing changed: still connected to genie://127.0.0.1:{port}, session {session}" in line, line
        assert len(line.splitlines()) == 1, line
        # the init widget's text form (front ends without widgets) is the progress, then the failure
        shown = [m["content"]["data"]["text/plain"] for _, m in msgs if "display_data" in m["msg_type"]]
        assert shown[0].startswith("connecting to 127.0.0.1:"), shown
        assert shown[-1].splitlines()[-1].startswith("✗ not connected to 127.0.0.1:"), shown
        reply, msgs = execute(kc, "%%remote\nprint(kept)")
        assert reply["status"] == "ok" and stdout(msgs) == "my names\n", (cell, msgs)

    hole = _black_hole()  # the cancelled init: Ctrl-C (the interrupt button) while it waits
    try:
        msg_id = kc.execute(f"%genie_init 127.0.0.1:{hole.getsockname()[1]} --token some-token-0123456789")
        time.sleep(1.5)
        km.interrupt_kernel()
        reply = reply_to(kc, msg_id, timeout=15)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    finally:
        hole.close()
    reply, msgs = execute(kc, "%%remote\nprint(kept)")
    assert reply["status"] == "ok" and stdout(msgs) == "my names\n", msgs
    assert _value(kc, "genie_core.get_cluster_state().client.session == before") == "True"


# The tests above share the module's connected kernel; the ones below replace its connection.


def test_embedded_local_server_in_a_kernel(kernel):
    _, kc = kernel
    execute(kc, "%load_ext genie_jupyter")
    reply, msgs = execute(kc, "%genie_init")
    assert reply["status"] == "ok" and "embedded local server" in init_summary(msgs)
    views = [
        m
        for _, m in msgs
        if m["msg_type"] == "display_data" and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]
    ]
    assert views and views[0]["content"]["data"]["text/plain"]  # the init widget, with a text fallback
    reply, msgs = execute(kc, "%%remote\nprint('from the embedded server')")
    assert stdout(msgs) == "from the embedded server\n"
    execute(kc, "%genie_shutdown")


@pytest.mark.repeat(STRESS)
def test_server_killed_mid_cell_fails_with_connection_lost(kernel, tmp_path):
    from conftest import start_server

    srv = start_server(tmp_path)
    _, kc = kernel
    execute(kc, "%load_ext genie_jupyter")
    execute(kc, f"%genie_init 127.0.0.1:{srv.info.port} --token {srv.info.token}")
    msg_id = kc.execute("%%remote\nimport time\ntime.sleep(60)")
    time.sleep(0.5)
    srv.proc.kill()
    start = time.monotonic()
    reply = kc.get_shell_msg(timeout=15)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert time.monotonic() - start < 6
    assert reply["content"]["ename"] == "ConnectionLost"
    assert "lost" in plain("\n".join(reply["content"]["traceback"]))
    srv.stop()


def test_a_killed_kernel_has_its_session_reaped_and_its_worker_memory_freed(tmp_path):
    """The notebook's kernel dies (SIGKILL: no goodbye). Within the session lease the server
    ends the session: its worker exits, and the memory it held goes with it."""
    import psutil
    from conftest import start_server, wait_until
    from reliability import record

    from genie_core.client import Client

    srv = start_server(tmp_path, env={"GENIE_SESSION_LEASE": "3"})
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        execute(kc, "%load_ext genie_jupyter")
        reply, msgs = execute(kc, f"%genie_init 127.0.0.1:{srv.info.port} --token {srv.info.token}")
        assert reply["status"] == "ok", msgs
        reply, msgs = execute(
            kc, "%%remote\nimport os, torch\nheld = torch.ones(64 << 20)\nprint(os.getpid())"
        )  # 256 MiB
        worker = psutil.Process(int(stdout(msgs).strip()))
        assert worker.memory_info().rss > 256 << 20
        km.signal_kernel(signal.SIGKILL)  # as when the kernel process is killed or its machine drops off
        killed = time.monotonic()
        assert wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 15)
        took = time.monotonic() - killed
        assert took < 3 + 1.5  # the lease, plus a housekeeping round and a worker's exit
        probe = Client(srv.info.ip, srv.info.port, srv.info.token, timeout=10, purpose="probe").connect()
        sessions = [s for s in probe.info()["sessions"] if s["client"].get("purpose") != "probe"]
        probe.close()
        assert sessions == []
        record(
            "Client vanishes",
            "kernel SIGKILLed while its worker held 256 MiB (lease 3 s)",
            f"session ended and worker gone {took:.1f} s later, its memory with it",
        )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        srv.stop()
