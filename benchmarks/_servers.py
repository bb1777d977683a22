"""Start `genie serve` subprocesses for benchmarks."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from genie_core.config import ConnectionInfo
from genie_core.local_server import start_server_process, stop_process


def start(*args: str, prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, ConnectionInfo]:
    """`genie serve ARGS` (behind `prefix`, e.g. a network namespace's `ip netns exec NS`), ready."""
    folder = Path(tempfile.mkdtemp(prefix="genie-bench-"))
    env = dict(
        os.environ,
        GENIE_TOKEN=os.urandom(16).hex(),
        GENIE_STATE_DIR=str(folder / "state"),
        GENIE_RUNTIME_DIR=str(folder),
    )
    proc, info, _ = start_server_process(
        "--port", "0", *args, env=env, connection_file=folder / "server.json", stderr=subprocess.DEVNULL, prefix=prefix
    )
    return proc, info


stop = stop_process
