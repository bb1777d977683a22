"""`genie serve` as a user runs it."""

import json
import os
import signal
import stat
import subprocess
import sys

import pytest
from conftest import start_server


def test_serve_prints_one_ready_line_and_a_private_connection_file(tmp_path):
    srv = start_server(tmp_path, "--node-id", "node-a")
    try:
        assert srv.ready_line.startswith(f"genie server ready at genie://127.0.0.1:{srv.info.port}")
        assert str(srv.connection_file) in srv.ready_line and "node node-a" in srv.ready_line
        assert stat.S_IMODE(os.stat(srv.connection_file).st_mode) == 0o600
        data = json.loads(srv.connection_file.read_text())
        assert set(data) == {"ip", "port", "token", "node_id", "pid", "protocol"}
        assert (
            data["pid"] == srv.proc.pid
            and data["node_id"] == "node-a"
            and data["token"] == os.environ.get("GENIE_TOKEN", data["token"])
        )
    finally:
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(10) == 0
    assert "stopped" in srv.proc.stdout.read()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "99999"], "out of range"),
        (["--port", "http"], "not a port number"),
        (["--gpus", "a,b"], "invalid GPU list"),
        (["--max-session-bytes", "12XB"], "invalid size '12XB'"),
        (["--max-session-tensors", "0"], "invalid max_session_tensors 0"),
    ],
)
def test_bad_arguments_give_one_clear_line(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "genie_core", "serve", *args], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_port_in_use_is_one_clear_line(tmp_path):
    srv = start_server(tmp_path)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "genie_core", "serve", "--port", str(srv.info.port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2
        assert f"cannot listen on 127.0.0.1:{srv.info.port}" in result.stderr and "Traceback" not in result.stderr
    finally:
        srv.stop()


def test_console_script_is_installed():
    result = subprocess.run(["genie", "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "serve" in result.stdout and "demo" in result.stdout
