"""A cgroup per sandboxed worker: memory, processes and CPU time bounded, and asked afterwards
whether a limit is what ended it. cgroup v1 (one hierarchy per controller, what these machines
mount) or v2 (one unified hierarchy); created under the server's own cgroup."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .. import errors

ROOT = Path("/sys/fs/cgroup")
V1 = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


def _own_paths() -> dict[str, str]:
    """This process's cgroup, per v1 controller ("" for v2's unified hierarchy)."""
    found: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            found[name] = path
    return found


def _v2() -> bool:
    return (ROOT / "cgroup.controllers").is_file()


def _parents() -> dict[str, Path]:
    """Where this server's workers' cgroups go, per controller (v2: one, keyed "")."""
    own = _own_paths()
    if _v2():
        return {"": ROOT / own.get("", "/").lstrip("/") / f"genie-{os.getpid()}"}
    return {c: ROOT / c / own.get(c, "/").lstrip("/") / f"genie-{os.getpid()}" for c in V1 if (ROOT / c).is_dir()}


def cgroup_support() -> tuple[bool, str]:
    """Whether per-worker limits can be set here, and what they are made of (or why not)."""
    parents = _parents()
    if not parents or (not _v2() and set(parents) != set(V1)):
        missing = ", ".join(c for c in V1 if c not in parents)
        return False, f"no cgroup v2 and no v1 {missing} controller mounted under {ROOT}"
    try:
        for parent in parents.values():
            parent.mkdir(exist_ok=True)
        if _v2():
            (parents[""] / "cgroup.subtree_control").write_text("+memory +pids +cpu")
    except OSError as exc:
        return False, f"cannot make cgroups under {next(iter(parents.values())).parent}: {exc.strerror}"
    if not _v2():  # made again by the first worker's cgroup: a probe leaves nothing behind
        for parent in parents.values():
            with contextlib.suppress(OSError):
                parent.rmdir()
    kind = "v2" if _v2() else "v1 memory, pids and cpu"
    return True, f"memory, processes and CPU bounded per session (cgroup {kind})"


class WorkerCgroup:
    """One worker's cgroup (one per controller on v1)."""

    def __init__(self, name: str, memory: int | None, processes: int | None, cpus: float | None) -> None:
        self.memory = memory
        self.dirs: dict[str, Path] = {c: parent / name for c, parent in _parents().items()}
        for path in self.dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        if _v2():
            base = self.dirs[""]
            self._write(base / "memory.max", "max" if memory is None else str(memory))
            self._write(base / "memory.swap.max", "0" if memory is not None else "max", optional=True)
            self._write(base / "pids.max", "max" if processes is None else str(processes))
            quota = "max" if cpus is None else str(int(cpus * CPU_PERIOD_US))
            self._write(base / "cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            if memory is not None:
                self._write(self.dirs["memory"] / "memory.limit_in_bytes", str(memory))
                self._write(self.dirs["memory"] / "memory.memsw.limit_in_bytes", str(memory), optional=True)
            self._write(self.dirs["pids"] / "pids.max", "max" if processes is None else str(processes))
            if cpus is not None:
                self._write(self.dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                self._write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(int(cpus * CPU_PERIOD_US)))

    @staticmethod
    def _write(path: Path, value: str, optional: bool = False) -> None:
        try:
            path.write_text(value)
        except OSError:
            if not optional:
                raise

    def procs_files(self) -> list[str]:
        """Where the worker writes its own pid before it becomes the sandbox (so all it starts is in)."""
        return [str(path / "cgroup.procs") for path in self.dirs.values()]

    def _read(self, controller: str, name: str) -> str:
        try:
            return (self.dirs[controller] / name).read_text()
        except (OSError, KeyError):
            return ""

    def _count(self, controller: str, name: str, key: str) -> int:
        for line in self._read(controller, name).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
        return 0

    def memory_killed(self) -> bool:
        if "" in self.dirs:
            return self._count("", "memory.events", "oom_kill") > 0
        return self._count("memory", "memory.oom_control", "oom_kill") > 0

    def why_ended(self) -> str:
        """The limit that ended the worker, said for the user; "" if none did."""
        if self.memory is not None and self.memory_killed():
            return f"went over its memory limit, {errors.size_text(self.memory)} (--session-memory)"
        return ""

    def remove(self) -> bool:
        """Once its processes are gone (the PID namespace ends with the worker); False while one
        is still on its way out (never blocks: the caller tries again later)."""
        done = True
        for path in self.dirs.values():
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                done = False
        return done

    @staticmethod
    def remove_parents() -> None:
        for parent in _parents().values():
            with contextlib.suppress(OSError):
                parent.rmdir()

    @staticmethod
    def sweep() -> None:
        """The cgroups of servers that died without removing theirs (genie-PID, emptied by then:
        their workers died with them)."""
        for parent in _parents().values():
            for dead in parent.parent.glob("genie-[0-9]*"):
                pid = dead.name.split("-", 1)[1]
                if not pid.isdigit() or Path(f"/proc/{pid}").exists():
                    continue
                for path in [*dead.glob("worker-*"), dead]:
                    with contextlib.suppress(OSError):
                        path.rmdir()
