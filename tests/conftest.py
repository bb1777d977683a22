"""Shared fixtures: a real `genie serve` subprocess on 127.0.0.1 with a random port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from genie_core.client import Client
from genie_core.config import ConnectionInfo
from genie_core.dataplane.segment import creator_pid
from genie_core.local_server import start_server_process, stop_process

# The files that start a Ray cluster. Two clusters at once on two cores starve each other (a local
# head then took over 120 s to start), so these files share one test process, one after another.
RAY_FILES = ("test_pool", "test_benchmarks", "05_pool")

# The order files start in, longest first so that the test processes finish together
# (measured in CI runs). The files that start Ray run first, in one test process (see
# RAY_FILES), beside files that load the CPU without timing anything; the fault tests, whose
# timeouts are seconds, come after, once the Ray clusters are gone.
LONGEST_FIRST = (
    *RAY_FILES,
    "test_soak",
    "test_conformance_opinfo",
    "test_fuzz",
    "test_transport",
    "test_interrupts",
    "test_connect",
    "test_netns",
    "test_kernel",
)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadfile`, except that the files in RAY_FILES are one unit of work."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "files that start Ray" if Path(path).stem in RAY_FILES else path

    return RayFilesTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first; `@pytest.mark.gpu` tests need a CUDA GPU here (the server they
    start then computes on it)."""

    def rank(item: pytest.Item) -> int:
        stem = item.path.stem
        return LONGEST_FIRST.index(stem) if stem in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order
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

    def segments(self, prefix: str = "genie-") -> set[Path]:
        """Shared-memory segments of this test process, this server and its workers: the other
        test process makes its own (discovery probes, pushes) at the same time."""
        import psutil

        pids = {os.getpid(), self.proc.pid}
        try:
            pids.update(child.pid for child in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        return {p for p in Path("/dev/shm").glob(f"{prefix}*") if creator_pid(p.name) in pids}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a test may have paused it
        stop_process(self.proc)
        # A server killed by a test (SIGKILL) could not clean up; its next start would sweep.
        from genie_core.dataplane.segment import sweep_dead

        sweep_dead()


# The server's Python: another venv's (another torch) when the torch-range lane runs client and
# server on different torch versions (scripts/test-torch-range)
SERVER_PYTHON = os.environ.get("GENIE_TEST_SERVER_PYTHON") or sys.executable


def start_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> RunningServer:
    cf = tmp_path / f"server-{os.urandom(3).hex()}.json"
    full_env = dict(
        os.environ, GENIE_TOKEN="test-token-" + os.urandom(8).hex(), GENIE_STATE_DIR=str(tmp_path / "state")
    )
    full_env.update(env or {})
    with open(tmp_path / f"{cf.stem}.log", "w") as log:  # read by nobody while running: a file never fills up
        proc, info, line = start_server_process(
            "--port", "0", *args, env=full_env, connection_file=cf, stderr=log, python=SERVER_PYTHON
        )
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


@contextlib.contextmanager
def session_on(srv: RunningServer, timeout: float = 20.0, **settings: Any) -> Iterator[RunningServer]:
    """genie_core's session on `srv` (`init_sync`, as a notebook's); then shut down, the server stopped."""
    import genie_core

    try:
        genie_core.init_sync(f"127.0.0.1:{srv.info.port}", token=srv.info.token, timeout=timeout, **settings)
        yield srv
    finally:
        genie_core.shutdown_sync()
        srv.stop()


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A module's session on a CPU server (even on a GPU machine), for remote_accelerator tests."""
    with session_on(start_server(tmp_path_factory.mktemp("remote"), "--gpus", "")) as srv:
        yield srv


@pytest.fixture(scope="module")
def quiet_transformers() -> None:
    """transformers' warnings off for a module of model tests (they say nothing about the device)."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")


def run(client: Client, code: str, timeout: float = 30.0, **kwargs) -> list:
    """Execute and collect (type, content) of every reply, ending with execute_reply."""
    return [(m.type, m.content) for m in client.execute(code, **kwargs).replies(timeout)]


def worker_pid(client: Client) -> int:
    """The host pid of the client's session worker (a sandboxed cell's own pid is its namespace's)."""
    import psutil

    wid = stdout_of(run(client, "import os; print(os.environ['GENIE_WORKER_ID'])")).strip()
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd[1:3] == ["-m", "genie_core.worker"] and wid in cmd:
            return proc.pid
    raise AssertionError(f"no worker process {wid} on this host")


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
_repeats: dict[str, list[str]] = {}  # test -> each run's outcome: "passed", "failed" or the skip's reason


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
    if report.skipped:
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        ran = why.removeprefix("Skipped: ")
    else:
        ran = "passed" if report.passed else "failed"
    _repeats.setdefault(name, []).append(ran)


def _runs_text(runs: list[str]) -> str:
    """How a repeated test went, a skip said as one (never as runs that failed)."""
    ran = [r for r in runs if r in ("passed", "failed")]
    skips = sorted({r for r in runs if r not in ("passed", "failed")})
    text = f"{ran.count('passed')} of {len(ran)} runs passed" if ran else ""
    if skips:
        text += ("; " if text else "") + f"skipped ({len(runs) - len(ran)} runs): {'; '.join(skips)}"
    return text


_durations: dict[str, float] = {}
_began = time.time()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's time (setup, call and teardown; with pytest-xdist, reported to the controller);
    with GENIE_FAILURE_LOG, each failure's traceback written there as it happens (pytest prints
    them at the end: a run ended at a limit, as on a lent GPU machine, would lose them)."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    failures = os.environ.get("GENIE_FAILURE_LOG")
    if failures and report.failed:
        with open(failures, "a") as fh:
            fh.write(f"== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")


def _by_file() -> list[tuple[str, float]]:
    totals: dict[str, float] = {}
    for nodeid, seconds in _durations.items():
        path = nodeid.split("::", 1)[0]
        totals[path] = totals.get(path, 0.0) + seconds
    return sorted(totals.items(), key=lambda kv: -kv[1])


def _write_slowest() -> None:
    """test-artifacts/slowest.md: the run's 20 slowest tests, so the next person sees where the time goes."""
    slowest = sorted(_durations.items(), key=lambda kv: -kv[1])[:20]
    lines = [
        f"# The 20 slowest tests of the run of {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"{len(_durations)} tests, {sum(_durations.values()) / 60:.1f} minutes of test time, "
        f"{(time.time() - _began) / 60:.1f} minutes of wall time.",
        "",
        "| seconds | test |",
        "| --- | --- |",
        *[f"| {seconds:.1f} | `{nodeid}` |" for nodeid, seconds in slowest],
        "",
        "The files that take longest (a file's tests run in one test process, one after another):",
        "",
        "| seconds | file |",
        "| --- | --- |",
        *[f"| {seconds:.1f} | `{path}` |" for path, seconds in _by_file()[:15]],
    ]
    from reliability import ARTIFACTS

    out = ARTIFACTS / "slowest.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("genie-*")} if Path("/dev/shm").is_dir() else set()


_segments_before: set[str] = set()
_heads_before: set[str] = set()


def _local_heads() -> set[str]:
    """Folders of local Ray heads that `genie pool up` started (genie_core.pool.head)."""
    import tempfile

    return {str(p) for p in Path(tempfile.gettempdir()).glob("genie-ray-*")}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Once per run (in the controller when pytest-xdist runs the tests in workers)."""
    if _is_xdist_worker(session.config):
        return
    import reliability

    reliability.reset()
    _segments_before.update(_segments())
    _heads_before.update(_local_heads())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Each test process records its repeated tests; the run's last process writes the document
    and checks that no shared-memory segment outlived the servers and workers that made it."""
    import reliability

    for name, runs in sorted(_repeats.items()):
        reliability.record("Repeated fault-path tests (flaky is failing)", name, _runs_text(runs))
    if _is_xdist_worker(session.config):
        return
    reliability.write_document()
    _write_slowest()
    from genie_core.pool.head import stop_local_head

    for folder in _local_heads() - _heads_before:  # a notebook that failed before `genie pool down`
        stop_local_head(folder)
    time.sleep(0.5)
    leaked = sorted(name for name in _segments() - _segments_before if _orphaned(name))
    if leaked:
        session.config.get_terminal_writer().line(f"leaked shared-memory segments: {leaked}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _orphaned(name: str) -> bool:
    """Its creator is gone (or is this process): nobody will remove it. Live processes elsewhere on
    the machine are not ours to judge."""
    pid = creator_pid(name)
    if pid is None or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


class PostgreSQL:
    """A private PostgreSQL server for one test run: its own data folder, a Unix socket in its own
    folder, no TCP port. Started as the postgres user (PostgreSQL refuses to run as root)."""

    def __init__(self) -> None:
        import glob
        import pwd
        import shutil
        import tempfile

        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        bindir = Path(found[-1]).parent if found else None
        if bindir is None and shutil.which("initdb"):
            bindir = Path(shutil.which("initdb") or "").parent
        if bindir is None:
            pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql; scripts/test installs it)")
        self.bindir = bindir
        self.home = Path(tempfile.mkdtemp(prefix="genie-pg-"))
        self.data, self.socket = self.home / "data", self.home / "socket"
        self.socket.mkdir()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            for path in (self.home, self.socket):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "genie", "--no-sync")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.as_user, str(self.bindir / tool), *args], capture_output=True, text=True)
        assert done.returncode == 0, f"{tool}: {done.stderr or done.stdout}"

    @property
    def url(self) -> str:
        return f"postgresql://genie@/postgres?host={self.socket}"

    def start(self) -> None:
        options = f"-c listen_addresses='' -k {self.socket} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.home / "log"), "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")


@pytest.fixture(scope="session")
def postgresql():
    import shutil

    server = PostgreSQL()
    yield server
    server.stop()
    shutil.rmtree(server.home, ignore_errors=True)
