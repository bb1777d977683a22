"""Shared fixtures: a real `genie serve` subprocess on 127.0.0.1 with a random port."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from genie_core.client import Client
from genie_core.config import ConnectionInfo
from genie_core.local_server import start_server_process, stop_process


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`@pytest.mark.gpu` tests need a CUDA GPU here (the server they start then computes on it)."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in gpu_tests:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _private_runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["GENIE_RUNTIME_DIR"] = str(tmp_path_factory.mktemp("genie-runtime"))
    os.environ["GENIE_STATE_DIR"] = str(tmp_path_factory.mktemp("genie-state"))


@dataclass
class RunningServer:
    proc: subprocess.Popen
    info: ConnectionInfo
    connection_file: Path
    ready_line: str

    @property
    def address(self) -> str:
        return f"{self.info.ip}:{self.info.port}"

    def client(self, **kwargs) -> Client:
        return Client(
            self.info.ip,
            self.info.port,
            self.info.token,
            timeout=kwargs.pop("timeout", 10.0),
            curve=self.info.curve,
            **kwargs,
        ).connect()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a test may have paused it
        stop_process(self.proc)
        # A server killed by a test (SIGKILL) could not clean up; its next start would sweep.
        from genie_core.dataplane.segment import sweep_dead

        sweep_dead()


def start_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> RunningServer:
    cf = tmp_path / f"server-{os.urandom(3).hex()}.json"
    full_env = dict(
        os.environ, GENIE_TOKEN="test-token-" + os.urandom(8).hex(), GENIE_STATE_DIR=str(tmp_path / "state")
    )
    full_env.update(env or {})
    with open(tmp_path / f"{cf.stem}.log", "w") as log:  # read by nobody while running: a file never fills up
        proc, info, line = start_server_process("--port", "0", *args, env=full_env, connection_file=cf, stderr=log)
    return RunningServer(proc, info, cf, line)


@pytest.fixture
def server(tmp_path: Path):
    srv = start_server(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture
def client(server: RunningServer):
    c = server.client()
    yield c
    c.close()


def run(client: Client, code: str, timeout: float = 30.0, **kwargs) -> list:
    """Execute and collect (type, content) of every reply, ending with execute_reply."""
    return [(m.type, m.content) for m in client.execute(code, **kwargs).replies(timeout)]


def stdout_of(replies: list) -> str:
    return "".join(c["text"] for t, c in replies if t == "stream" and c["name"] == "stdout")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def plain(text: str) -> str:
    """Text without ANSI colour codes."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


STRESS = int(os.environ.get("GENIE_STRESS_REPEATS", "5"))  # runs of each fault-path test (pytest-repeat)
_repeats: dict[str, list[bool]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Count the runs of each repeated test: docs/RELIABILITY.md says how many passed."""
    outcome = yield
    report = outcome.get_result()
    if item.get_closest_marker("repeat") is None or report.when not in ("setup", "call"):
        return
    if report.when == "setup" and report.passed:
        return  # counted at its call
    import re

    case = re.sub(r"-?\d+-\d+$", "", getattr(getattr(item, "callspec", None), "id", ""))  # less pytest-repeat's "3-5"
    name = f"{item.module.__name__}::{item.originalname}" + (f"[{case}]" if case else "")
    _repeats.setdefault(name, []).append(report.passed)


@pytest.fixture(scope="session", autouse=True)
def _reliability_document():
    import reliability

    reliability.reset()
    yield
    for name, runs in sorted(_repeats.items()):
        reliability.record(
            "Repeated fault-path tests (flaky is failing)", name, f"{sum(runs)} of {len(runs)} runs passed"
        )
    reliability.write_document()


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_segments():
    """Shared-memory segments must not outlive the servers and workers that made them."""
    before = {p.name for p in Path("/dev/shm").glob("genie-*")} if Path("/dev/shm").is_dir() else set()
    yield
    time.sleep(0.5)
    after = {p.name for p in Path("/dev/shm").glob("genie-*")} if Path("/dev/shm").is_dir() else set()

    def orphaned(name: str) -> bool:  # its creator is gone (or is this test process): nobody will remove it
        parts = name.split("-")
        if len(parts) < 4 or not parts[2].isdigit():
            return True
        pid = int(parts[2])
        if pid == os.getpid():
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    leaked = sorted(
        n for n in after - before if orphaned(n)
    )  # live processes elsewhere on the machine are not ours to judge
    assert not leaked, f"leaked shared-memory segments: {leaked}"
