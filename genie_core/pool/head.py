"""The embedded default of `genie pool up`: a local Ray head, started as its own processes.

Session actors are detached: they live as long as the Ray cluster, not as long as the pool
endpoint. So the head must not be this process (`ray.init()` would end every session when the
endpoint stops); `ray start --head` runs it apart, and a later `genie pool up` finds it again.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import ConfigError

# Ray notices a dead node after period x threshold (defaults: 3 s x 5, plus a 10 s timeout);
# a pool reports lost sessions within seconds, so it checks each second and gives up after 3.
HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


def node_loss_seconds() -> tuple[float, str]:
    """About how long Ray (so the pool) takes to see that a node died, from the health checks of
    the cluster joined (its system config, else Ray's defaults), with how they are set."""
    import ray

    try:
        overrides = ray._private.state.state.get_system_config()
    except Exception:  # an older or newer Ray without it: its defaults, as this driver sees them
        overrides = {}

    def setting(name: str) -> float:
        return float(overrides.get(name, getattr(ray._config, name)()))

    period, threshold = setting("health_check_period_ms") / 1000, setting("health_check_failure_threshold")
    return period * threshold, f"Ray's health checks: every {period:g} s, {threshold:g} missed"


# The `ray start` options that make a node loss seen in about 3 s (Ray's defaults take 12 s or more).
RAY_START_HEALTH_CHECKS = f"--system-config='{json.dumps(HEALTH_CHECKS, separators=(',', ':'))}'"


# Ray puts a node on this machine's network address, even when told 127.0.0.1, unless multi-node
# clusters are off, as they are on Windows and macOS; then every address is the loopback. A local
# head is for one machine (and Ray's ports have no authentication), so it runs that way.
LOCAL_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def local_auth(token_file: Path) -> dict[str, str]:
    """The environment that gives a local head of genie's own, and every process that joins it,
    Ray's token authentication with a token of its own (made once, readable by its owner only).
    Left to Ray's defaults, a ~/.ray/auth_token that any earlier `ray.init()` leaves behind turns
    token mode on in `ray start --head` but not in `ray.init(address=...)`, which is then refused."""
    if not token_file.exists():
        token_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_local_head(gpus: int, cpus: int | None = None, attempts: int = 3) -> tuple[str, str]:
    """Start a Ray head on this machine declaring `gpus` GPUs, its files in a folder of its own;
    returns its address and that folder (every process of it names the folder: see `stop_local_head`).
    A port taken between choosing it and Ray binding it costs another attempt, not the pool."""
    for attempt in range(attempts):
        try:
            return _start_head(gpus, cpus)
        except ConfigError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _start_head(gpus: int, cpus: int | None) -> tuple[str, str]:
    port = _free_port()
    folder = Path(tempfile.gettempdir()) / f"genie-ray-{port}"  # short: Ray's Unix sockets live under it
    command = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--num-gpus={gpus}",
        f"--temp-dir={folder}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--system-config={json.dumps(HEALTH_CHECKS)}",
    ]
    if cpus is not None:
        command.append(f"--num-cpus={cpus}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a head of its own, not a client of one
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**env, **LOCAL_ONLY})
    except subprocess.TimeoutExpired:
        stop_local_head(str(folder))
        raise ConfigError("a local Ray head did not start within 120 s") from None
    if done.returncode != 0:
        stop_local_head(str(folder))
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError("could not start a local Ray head: " + " | ".join(tail))
    return f"127.0.0.1:{port}", str(folder)


def stop_local_head(folder: str, grace: float = 5.0) -> int:
    """End the processes of the head whose files are in `folder` (and no other Ray on this machine:
    `ray stop` would end them all). Returns how many there were."""
    inside = folder.rstrip("/").encode() + b"/"
    mine = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.stat().st_uid != os.getuid():
                continue
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # Ray's processes name files inside the folder (--session_dir=FOLDER/session_..., sockets...)
        if any(inside in arg or arg.endswith(b"=" + inside[:-1]) for arg in args):
            mine.append(int(proc.name))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in mine:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in mine):
            time.sleep(0.1)
    shutil.rmtree(folder, ignore_errors=True)
    return len(mine)
