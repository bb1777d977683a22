"""The server's handle on one worker process: start, interrupt, stop, and why it ended."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..protocol import Message
    from .session import Session

CPU = -1  # the device slot of a worker that uses no GPU


def describe_exit(returncode: int | None, pid: int | None = None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if -returncode != signal.SIGKILL:
            return f"was killed by {name}"
        oom = oom_kill_record(pid) if pid is not None else None
        if oom is None:
            return f"was killed by {name} (out of memory? the kernel log, which would say, is not readable here)"
        if oom:
            return f"was killed by the kernel's out-of-memory killer ({oom})"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def oom_kill_record(pid: int, records: int = 20000) -> str | None:
    """The kernel's own words if it killed `pid` for lack of memory; "" if it did not; None if
    the kernel log cannot be read (it needs root or CAP_SYSLOG)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = ""
    try:
        for _ in range(records):  # bounded: the ring buffer holds a few thousand records
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records overwritten while reading; go on with the next
                continue
            match = re.search(rf"([^;]*Killed process {pid} \([^)]*\))", record)
            if match:
                found = match.group(1).strip()
    finally:
        os.close(fd)
    return found


def sweep_orphans() -> int:
    """End the workers of servers that died without ending them (and their process groups).
    The lifeline makes this rare; a worker that ignored SIGIO is one way to need it."""
    ended = 0
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if proc_dir.stat().st_uid != os.getuid():
                continue
            argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"genie_core.worker" not in argv[:3] or len(argv) < 7 or not argv[6].isdigit():
            continue
        try:  # the 4th field of stat is the parent: a worker whose server died was re-parented
            parent = int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent != int(argv[6]):
            try:
                os.killpg(int(proc_dir.name), signal.SIGKILL)  # a worker leads its own process group
                ended += 1
            except OSError:
                pass
    return ended


class WorkerProcess:
    def __init__(self, worker_id: str, slot: int, endpoint: str, lifeline: int, limits: dict[str, Any] | None = None) -> None:
        self.id = worker_id
        self.slot = slot
        env = dict(os.environ)
        for name, value in (limits or {}).items():  # the worker enforces the session limits itself
            env[f"GENIE_LIMIT_{name.upper()}"] = "" if value is None else str(value)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so CUDA's GPU N is NVML's (and nvidia-smi's) GPU N
        env["CUDA_VISIBLE_DEVICES"] = "" if slot == CPU else str(slot)
        env["GENIE_WORKER_ID"] = worker_id
        env.pop("GENIE_TOKEN", None)  # user code has no business with the server's token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "genie_core.worker", endpoint, worker_id, str(lifeline), str(os.getpid())],
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=(lifeline,),  # it ends when we do, however we end (see genie_core.lifeline)
            start_new_session=True,  # a Ctrl-C at the server's terminal is the server's, not the cell's
        )
        self.started = time.monotonic()
        self.ready = False
        self.session: Session | None = None
        self.waiting: list[Message] = []  # requests that arrived before the worker was ready
        self.inflight: dict[str, Message] = {}  # request id -> request
        self.stop_requested: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def busy(self) -> bool:
        return any(m.type == "execute" for m in self.inflight.values())

    def stop(self) -> None:
        """Ask it, and the processes its cells started, to end now (SIGTERM to its process
        group); `reap` escalates to SIGKILL if it lingers."""
        if self.stop_requested is None:
            self.stop_requested = time.monotonic()
            self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)  # it leads its own process group (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self, grace: float = 2.0) -> bool:
        """True once the process is gone."""
        if self.proc.poll() is not None:
            self._signal_group(signal.SIGKILL)  # what its cells started and left behind
            return True
        if self.stop_requested is not None and time.monotonic() - self.stop_requested > grace:
            self.kill()
        return False

    def info(self) -> dict[str, Any]:
        return {"id": self.id, "pid": self.pid, "slot": self.slot, "ready": self.ready, "busy": self.busy()}
