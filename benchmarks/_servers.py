"""Start `genie serve` subprocesses for benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from genie_core.config import ConnectionInfo


def start(*args: str) -> tuple[subprocess.Popen, ConnectionInfo]:
    folder = Path(tempfile.mkdtemp(prefix="genie-bench-"))
    cf = folder / "server.json"
    env = dict(os.environ, GENIE_TOKEN=os.urandom(16).hex(), GENIE_STATE_DIR=str(folder / "state"), GENIE_RUNTIME_DIR=str(folder))
    proc = subprocess.Popen(
        [sys.executable, "-m", "genie_core", "serve", "--port", "0", "--connection-file", str(cf), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    line = ""
    for _ in range(20):  # the ready line, past anything a library printed first
        line = proc.stdout.readline()
        if "ready" in line or not line:
            break
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, ConnectionInfo.read(cf)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
