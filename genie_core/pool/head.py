"""The embedded default of `genie pool up`: a local Ray head, started as its own processes.

Session actors are detached: they live as long as the Ray cluster, not as long as the pool
endpoint. So the head must not be this process (`ray.init()` would end every session when the
endpoint stops); `ray start --head` runs it apart, and a later `genie pool up` finds it again.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from ..errors import ConfigError

# Ray notices a dead node after period x threshold (defaults: 3 s x 5, plus a 10 s timeout);
# a pool reports lost sessions within seconds, so it checks each second and gives up after 3.
HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


# Ray puts a node on this machine's network address, even when told 127.0.0.1, unless multi-node
# clusters are off, as they are on Windows and macOS; then every address is the loopback. A local
# head is for one machine (and Ray's ports have no authentication), so it runs that way.
LOCAL_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_local_head(gpus: int, cpus: int | None = None) -> str:
    """Start a Ray head on this machine declaring `gpus` GPUs; returns its address."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--num-gpus={gpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--system-config={json.dumps(HEALTH_CHECKS)}",
    ]
    if cpus is not None:
        command.append(f"--num-cpus={cpus}")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ, **LOCAL_ONLY))
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError("could not start a local Ray head: " + " | ".join(tail))
    return f"127.0.0.1:{port}"


def stop_local_head() -> None:
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, timeout=60)
