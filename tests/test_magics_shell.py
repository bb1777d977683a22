"""The magics in an in-process IPython shell, against a real server."""

import numpy as np
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import genie_core
from genie_core.errors import NotInitializedError, RemoteError


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "genie_jupyter")
    ip.run_line_magic("load_ext", "genie_jupyter")  # loading twice is harmless
    yield ip
    genie_core.shutdown_sync()


@pytest.fixture
def connected(shell, server, capsys):
    shell.run_line_magic("genie_init", f"genie://127.0.0.1:{server.info.port} --token {server.info.token} --timeout 10")
    assert "Connected to genie server genie://127.0.0.1" in capsys.readouterr().out
    return shell


def test_a_minor_version_difference_is_a_warning_in_the_init_summary(shell, server, capsys, monkeypatch):
    from genie_core import versions

    mine = {**versions.local_versions(), "genie": "0.1.1"}
    monkeypatch.setattr(versions, "_versions", lambda: mine)
    shell.run_line_magic("genie_init", f"127.0.0.1:{server.info.port} --token {server.info.token} --timeout 10")
    out = capsys.readouterr().out
    assert out.count("Connected to genie server") == 1
    assert "warning: Genie versions differ: this client has genie 0.1.1, the server at 127.0.0.1" in out


def test_remote_before_init_says_what_to_run(shell):
    genie_core.shutdown_sync()
    result = shell.run_cell("%%remote\nprint(1)")
    assert isinstance(result.error_in_exec, NotInitializedError)
    assert "%genie_init" in str(result.error_in_exec)


def test_remote_cell_output_and_line_form(connected, capsys):
    result = connected.run_cell("%%remote\nx = 20\nprint('remote says', x + 1)")
    assert result.success
    assert "remote says 21" in capsys.readouterr().out
    connected.run_cell("%remote print(x * 2)")
    assert "40" in capsys.readouterr().out


def test_push_and_pull(connected):
    connected.user_ns["a"] = np.arange(4)
    assert connected.run_cell("%%remote --push a --pull b,c\nb = a * 3\nc = 'done'").success
    np.testing.assert_array_equal(connected.user_ns["b"], np.arange(4) * 3)
    assert connected.user_ns["c"] == "done"
    connected.user_ns["z"] = 5
    connected.run_line_magic("genie_push", "z")
    connected.run_cell("%remote w = z + 1")
    connected.run_line_magic("genie_pull", "w")
    assert connected.user_ns["w"] == 6


def test_push_to_a_device_that_does_not_exist_is_a_remote_error(connected):
    import torch

    connected.user_ns["t"] = torch.ones(2)
    result = connected.run_cell("%%remote --push t --to cuda:7\nprint(t.device)")
    assert isinstance(result.error_in_exec, RemoteError)  # this machine has no GPU: said, not ignored
    connected.run_line_magic("genie_push", "t --to cpu")
    connected.run_cell("%remote placed = str(t.device)")
    connected.run_line_magic("genie_pull", "placed")
    assert connected.user_ns["placed"] == "cpu"


def test_slow_transfers_show_a_progress_bar(connected, monkeypatch):
    import torch
    from IPython.utils.capture import capture_output

    from genie_jupyter import progress

    monkeypatch.setattr(progress, "DELAY", 0.0)  # every transfer counts as slow here
    genie_core.get_cluster_state().client.select_backend("tcp")
    connected.user_ns["big"] = torch.zeros(32 << 20)
    with capture_output() as captured:
        assert connected.run_cell("%genie_push big").success
    html = [o.data.get("text/html", "") for o in captured.outputs]
    assert html and "<progress" in html[0] and "MiB" in html[-1] and "/s" in html[-1]


def test_push_of_an_undefined_name_is_a_usage_error(connected):
    result = connected.run_cell("%%remote --push missing\n1")
    assert isinstance(result.error_in_exec, UsageError) and "missing" in str(result.error_in_exec)


def test_remote_error_raises_locally_with_the_remote_traceback(connected):
    result = connected.run_cell("%%remote\nraise ValueError('bad value on the server')")
    error = result.error_in_exec
    assert isinstance(error, RemoteError) and error.ename == "ValueError"
    assert "bad value on the server" in "".join(error._render_traceback_())


def test_timeout_interrupts_the_remote_cell(connected):
    result = connected.run_cell("%%remote --timeout 0.5\nimport time\ntime.sleep(30)")
    assert isinstance(result.error_in_exec, RemoteError) and result.error_in_exec.ename == "KeyboardInterrupt"


def test_shutdown(connected, capsys):
    connected.run_line_magic("genie_shutdown", "")
    assert "closed" in capsys.readouterr().out
    assert not genie_core.is_initialized()


def test_the_next_magic_says_whether_a_cell_cut_off_by_a_lost_connection_ran(shell, tmp_path, capsys, monkeypatch):
    import signal

    from conftest import start_server, wait_until

    from genie_core.errors import ConnectionLost

    monkeypatch.setenv("GENIE_HEARTBEAT_INTERVAL", "0.25")
    monkeypatch.setenv("GENIE_HEARTBEAT_TIMEOUT", "1.0")
    srv = start_server(tmp_path)
    try:
        shell.run_line_magic("genie_init", f"127.0.0.1:{srv.info.port} --token {srv.info.token}")
        srv.proc.send_signal(signal.SIGSTOP)
        result = shell.run_cell("%%remote\nprint('made it')\nk = 7")
        assert isinstance(result.error_in_exec, ConnectionLost) and "whether it ran is reported" in str(
            result.error_in_exec
        )
        srv.proc.send_signal(signal.SIGCONT)
        client = genie_core.get_cluster_state().client
        assert wait_until(lambda: client.connected and all(r.settled for r in client.lost_requests.values()), 10)
        capsys.readouterr()
        assert shell.run_cell("%remote print(k)").success
        out = capsys.readouterr()
        assert (
            "the cell sent at" in out.err
            and "(print('made it'))" in out.err
            and "ran on the server after all and finished ok" in out.err
        )
        assert "made it" in out.err and out.out.strip() == "7"
        assert (
            shell.run_cell("%remote print(k)").success and "ran on the server" not in capsys.readouterr().err
        )  # said once
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        genie_core.shutdown_sync()
        srv.stop()


def test_an_interrupt_pressed_while_the_cell_is_sent_interrupts_the_remote_cell(connected, monkeypatch):
    """The press lands inside `client.execute` (a real SIGINT to this process, sent from there): the
    request reaches the server, so the remote cell must be interrupted, not left running behind a
    local KeyboardInterrupt to block the next cell."""
    import os
    import signal

    client = genie_core.get_cluster_state().client
    send = client.execute

    def pressed_while_sending(code, **kw):
        request = send(code, **kw)
        os.kill(os.getpid(), signal.SIGINT)
        return request

    monkeypatch.setattr(client, "execute", pressed_while_sending)
    result = connected.run_cell("%%remote\nwhile True:\n    pass")
    monkeypatch.undo()
    error = result.error_in_exec
    assert isinstance(error, RemoteError) and error.ename == "KeyboardInterrupt", repr(error)
    assert connected.run_cell("%%remote --timeout 10\nprint('next')").success  # not behind a cell still running


def test_an_interrupt_pressed_as_the_reply_arrives_keeps_the_reply(connected, monkeypatch):
    """The press lands just after the cell's reply is taken from its queue (a real SIGINT to this
    process, sent from there): the cell has finished, so its result stands; the reply must not be
    dropped by a KeyboardInterrupt, leaving the magic to wait for one that already came."""
    import os
    import signal

    from genie_core.client.connection import Request

    take = Request.next

    def pressed_as_it_arrives(self, timeout=None):
        msg = take(self, timeout)
        if msg is not None and msg.type == "execute_reply":
            os.kill(os.getpid(), signal.SIGINT)
        return msg

    monkeypatch.setattr(Request, "next", pressed_as_it_arrives)
    result = connected.run_cell("%%remote\nsquares = [i * i for i in range(20000)]\nlen(squares)")
    monkeypatch.undo()
    assert result.success, repr(result.error_in_exec)
    assert connected.run_cell("%%remote --timeout 10\nprint('next')").success
