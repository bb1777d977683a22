"""An embedded server for a laptop with no GPU server: `genie serve` on 127.0.0.1 as a child
process, tied to this process's life (it stops when we stop, or when we die)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .config import ConnectionInfo, new_token, runtime_dir
from .errors import ConnectionFailed
from .lifeline import Lifeline


def start_server_process(
    *args: str,
    env: dict[str, str] | None = None,
    connection_file: str | os.PathLike[str] | None = None,
    stderr: Any = subprocess.PIPE,
    prefix: tuple[str, ...] = (),
    python: str = sys.executable,
) -> tuple[subprocess.Popen[str], ConnectionInfo, str]:
    """Run `genie serve ARGS` as a child process (behind `prefix`, e.g. `ip netns exec NS`; under
    another `python`, e.g. a venv with another torch); return it, its connection info and its ready
    line once it is ready (for tests, benchmarks and scripts that want a server of their own)."""
    cf = (
        Path(connection_file)
        if connection_file
        else runtime_dir() / f"genie-child-{os.getpid()}-{os.urandom(3).hex()}.json"
    )
    proc = subprocess.Popen(
        [*prefix, python, "-m", "genie_core", "serve", "--connection-file", str(cf), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    assert proc.stdout is not None  # stdout=PIPE
    line = ""
    for _ in range(20):  # the ready line, past anything a library printed first
        line = proc.stdout.readline()
        if "ready" in line or not line:
            break
    if "ready" not in line:
        proc.kill()
        raise ConnectionFailed(f"the genie server did not start: {line.strip()!r}")
    return proc, ConnectionInfo.read(cf), line.strip()


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not ended within `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LocalServer:
    def __init__(self, gpus: list[int] | None = None) -> None:
        self.gpus = gpus
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: ConnectionInfo | None = None
        tag = f"{os.getpid()}-{os.urandom(3).hex()}"
        self.connection_file = runtime_dir() / f"genie-local-{tag}.json"
        self.log_file = runtime_dir() / f"genie-local-{tag}.log"

    def start(self, timeout: float = 30.0) -> ConnectionInfo:
        env = dict(os.environ, GENIE_TOKEN=new_token())
        self.lifeline = Lifeline()  # the server stops when this process ends, however it ends
        cmd = [
            sys.executable,
            "-m",
            "genie_core",
            "serve",
            "--ip",
            "127.0.0.1",
            "--port",
            "0",
            "--connection-file",
            str(self.connection_file),
            "--lifeline-fd",
            str(self.lifeline.fd),
            "--no-ucx",
        ]
        if self.gpus is not None:
            cmd += ["--gpus", ",".join(map(str, self.gpus))]
        with open(self.log_file, "wb") as log:
            self.proc = self.lifeline.start(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.connection_file.exists():
                self.info = ConnectionInfo.read(self.connection_file)
                return self.info
            if self.proc.poll() is not None:
                raise ConnectionFailed(f"the embedded genie server exited at start-up: {self._log_tail()}")
            time.sleep(0.01)
        self.stop()
        raise ConnectionFailed(f"the embedded genie server did not start within {timeout:g} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            lines = Path(self.log_file).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:]) or "(empty log)"

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout)
            self.lifeline.close()
        self.connection_file.unlink(missing_ok=True)
        self.log_file.unlink(missing_ok=True)
