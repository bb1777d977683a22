"""The server's sandbox: starts each worker under bubblewrap with what its session may see, and
moves shared-memory segments in and out of the worker's private /dev/shm."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
from pathlib import Path

from ..dataplane.segment import SHM_DIR, segment_name
from ..nodes import GPUInfo
from .cgroups import WorkerCgroup
from .network import OutboundFence
from .policy import SandboxPolicy, probe
from .uids import UidLease, lease_uid

log = logging.getLogger("genie.server")

# Hidden from cells (an empty tmpfs over each): other users' and sessions' files, the server's
# state and connection files, Ray's session folder, cgroups (they list other workers' pids).
HIDDEN = ("/tmp", "/var/tmp", "/run", "/home", "/root", "/mnt", "/media", "/srv", "/sys/fs/cgroup")
ENV_KEPT = (
    *("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "MPLBACKEND", "GENIE_LOG_LEVEL"),
    "GENIE_CRASH_FD",  # genie_core/crash_record.py
    *("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"),
)
ENV_PREFIXES = ("LC_", "PYTHON", "CUDA_", "GENIE_LIMIT_", "OMP_", "MKL_", "COVERAGE_")
GPU_SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# Puts the worker in its cgroups (as its own uid, before it becomes the sandbox), then starts it.
JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def _under(path: Path, dirs: list[Path]) -> bool:
    return any(path == d or d in path.parents for d in dirs)


def _reachable(path: Path, depth: int = 2) -> tuple[list[Path], list[Path]]:
    """How to bind `path` so that other uids can read it: itself, or, for a folder only its owner
    may enter (a checkout in `mktemp -d`), a 0755 folder in its place with its entries bound
    inside. Returns (folders to make, paths to bind)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return [], []
    if mode & 0o005 == 0o005 or depth == 0 or not path.is_dir():
        return [], [path]
    folders, binds = [path], []
    for child in sorted(path.iterdir()):
        more, paths = _reachable(child, depth - 1)
        folders += more
        binds += paths
    return folders, binds


class Sandbox:
    """One per server. `dev` is where GPU device nodes are looked for (a test may point it at
    stand-ins: this machine has no GPU)."""

    def __init__(self, policy: SandboxPolicy, dev: Path = Path("/dev")) -> None:
        self.policy = policy
        self.protections = probe(policy)
        self.on = {p.name: p.on for p in self.protections}
        self.bwrap = shutil.which("bwrap") or "bwrap"
        self.dev = dev
        self.hidden = [Path(p) for p in HIDDEN if Path(p).exists()]
        self.exposed: list[Path] = []  # read-only inside though under a hidden folder (the workers' socket)
        resolver = Path("/etc/resolv.conf").resolve()  # systemd-resolved's lives in /run
        if resolver != Path("/etc/resolv.conf") and _under(resolver, self.hidden) and resolver.exists():
            self.exposed.append(resolver)
        self.masked: list[Path] = []  # files that read as empty inside (the connection file: it holds the token)
        self.empty = Path("/dev/null")
        self._view: list[str] | None = None  # see view()
        self.fence = (
            OutboundFence(policy, f"genie_sandbox_{os.getpid()}")
            if policy.network == "outbound" and self.on["network"]
            else None
        )

    def hide(self, path: Path) -> None:
        """Cells see an empty folder there (the server's state, runtime and worker folders)."""
        path = path.resolve()
        if path.is_dir() and path not in self.hidden:
            self.hidden.append(path)
            self._view = None

    def expose(self, path: Path) -> None:
        self.exposed.append(path.resolve())
        self._view = None

    def mask(self, path: Path, empty: Path) -> None:
        """`path` reads as the empty file `empty` inside (not /dev/null: a device on a nodev mount
        cannot be opened)."""
        self.masked.append(path.resolve())
        self.empty = empty
        self._view = None

    def view(self) -> list[str]:
        """bubblewrap's arguments for the file system every worker sees, worked out (stat, listing
        a checkout) once, not at each worker's start."""
        if self._view is None:
            args = []
            for hidden in self.hidden:
                args += ["--perms", "1777" if str(hidden) in ("/tmp", "/var/tmp") else "0755", "--tmpfs", str(hidden)]
            made, binds = [], []
            for path in self.readable_paths() + self.exposed:
                folders, paths = _reachable(path)
                made += folders
                binds += paths
            for folder in dict.fromkeys(self.folders_for([*binds, *made]) + made):
                args += ["--perms", "0755", "--dir", str(folder)]  # reachable by the session's uid
            for path in binds:
                args += ["--ro-bind", str(path), str(path)]
            for path in self.masked:
                args += ["--ro-bind", str(self.empty), str(path)]
            self._view = args
        return self._view

    def report(self) -> str:
        return "sandbox per session:\n" + "\n".join(f"  {p.line()}" for p in self.protections)

    def start(self) -> None:
        if self.fence is not None:
            self.fence.install()
        if self.on["limits"]:
            WorkerCgroup.sweep()

    def stop(self) -> None:
        if self.fence is not None:
            self.fence.remove()
        if self.on["limits"]:
            WorkerCgroup.remove_parents()

    def lease(self) -> UidLease | None:
        """A uid for a new session (None when the server cannot switch uids: not root)."""
        if not self.on["own uid"]:
            return None
        return lease_uid(self.policy.uid_base, self.policy.uid_count)

    def folders_for(self, paths: list[Path]) -> list[Path]:
        """The folders between a hidden folder and each path bound below it, parents first."""
        found: list[Path] = []
        for path in paths:
            for parent in reversed(path.parents):
                if any(h in parent.parents for h in self.hidden) and parent not in self.hidden:
                    found.append(parent)
        return list(dict.fromkeys(found))

    def readable_paths(self) -> list[Path]:
        """What the worker's Python needs that lies under a hidden folder (a venv in /tmp or /home)."""
        wanted = [Path(sys.prefix), Path(sys.base_prefix), Path(__file__).resolve().parents[2]]  # genie_core's folder
        cwd = Path.cwd().resolve()  # sys.path's "" (the server's folder, a home maybe): not for cells
        wanted += [Path(p) for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != cwd]
        found = [p.resolve() for p in wanted]
        return [
            p
            for p in dict.fromkeys(found)
            if _under(p, self.hidden)
            and p not in self.hidden
            and p.parent not in (Path("/home"), Path("/"))  # never a whole home
            and not any(p in h.parents for h in self.hidden)  # nor what would uncover a hidden folder
        ]


class SandboxedWorker:
    """A worker's sandbox: its home (the session directory), its private /dev/shm, its cgroup."""

    def __init__(self, sandbox: Sandbox, worker_id: str, home: Path, uid: int | None, gpu: GPUInfo | None):
        self.sandbox, self.home, self.uid, self.gpu = sandbox, home, uid, gpu
        self.shm = SHM_DIR / f"genie-sbx-{os.getpid()}-{worker_id}"
        for path in (home, self.shm):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if uid is not None:
                os.chown(path, uid, uid)
        policy = sandbox.policy
        self.cgroup = (
            WorkerCgroup(f"worker-{worker_id}", policy.memory_bytes, policy.processes, policy.cpus)
            if sandbox.on["limits"]
            else None
        )

    def command(self, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The worker's command line and environment, sandboxed. A root server runs bubblewrap
        privileged (no user namespace, so the mounts need no access of the session's uid) and
        the worker then becomes the session's uid through setpriv, with no capabilities left; a
        server of an ordinary user runs it in a user namespace, as that user."""
        sandbox = self.sandbox
        args = [sandbox.bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        args += ["--die-with-parent", "--cap-drop", "ALL"]
        if self.uid is None:
            args.append("--unshare-user")
        else:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        if sandbox.policy.network == "none":
            args.append("--unshare-net")
        args += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
        args += sandbox.view()
        for folder in sandbox.folders_for([self.home]):
            args += ["--perms", "0755", "--dir", str(folder)]  # the homes' folder, reachable by its uid
        args += ["--bind", str(self.home), str(self.home), "--bind", str(self.shm), "/dev/shm"]
        for node in self._gpu_nodes():
            args += ["--dev-bind", str(sandbox.dev / node), f"/dev/{node}"]
        args.append("--")  # no --chdir: the home is the session's uid's (0700); the worker goes there itself
        if self.uid is not None:
            args += ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--no-new-privs"]
            args += ["--inh-caps=-all", "--bounding-set=-all", "--"]
        args += argv
        if self.cgroup is not None:
            args = ["/bin/sh", "-c", JOIN_CGROUPS, "genie-sandbox", *self.cgroup.procs_files(), "--", *args]
        kept = {k: v for k, v in env.items() if k in ENV_KEPT or k.startswith(ENV_PREFIXES)}
        kept.update(HOME=str(self.home), TMPDIR="/tmp", USER="genie", GENIE_SANDBOXED="1")
        kept.update(IPYTHONDIR="/tmp/.ipython", MPLCONFIGDIR="/tmp/.matplotlib")  # not in the session's files
        kept["GENIE_WORKER_ID"] = env["GENIE_WORKER_ID"]
        if self.gpu and self.gpu.uuid:  # an index could mean another GPU once others are hidden
            kept["CUDA_VISIBLE_DEVICES"] = str(self.gpu.uuid)
        return args, kept

    def _gpu_nodes(self) -> list[str]:
        if self.gpu is None:
            return []
        nodes = [f"nvidia{self.gpu.index}", *GPU_SHARED_NODES]
        return [n for n in nodes if (self.sandbox.dev / n).exists()]

    # Shared memory: segments named on the wire live in the host's /dev/shm; the worker's is its own.
    def move_in(self, name: str) -> None:
        """A segment a request names (made by the client or a data listener) goes into the worker's
        /dev/shm under the same name: a rename on one tmpfs, no copy. Opened without following a
        link and given to the session's uid while still out of the worker's reach."""
        if "/" in name or not name.startswith("genie-"):
            return
        try:
            fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(f"{name} is not a regular file")
                if self.uid is not None:
                    os.fchown(fd, self.uid, self.uid)
            finally:
                os.close(fd)
            os.rename(SHM_DIR / name, self.shm / name)
        except FileNotFoundError:  # a lent segment the worker mapped before (dataplane/lent.py), or one
            pass  # that is gone: the worker says so in the request's reply
        except OSError as exc:  # the worker then says it cannot find it, in the request's reply
            log.warning("could not hand segment %s to a sandboxed worker: %s", name, exc)

    def move_out(self, name: str, host_pid: int) -> str:
        """A segment the worker staged goes to the host's /dev/shm, named as if the worker's host
        pid made it (the data listeners and the sweeps go by that); returns the new name, or ""
        when it is not a plain file the worker made (a link a cell planted to read the host's
        files through the server, say: it is removed)."""
        if "/" in name or not name.startswith("genie-"):
            return ""
        fresh = segment_name("genie-w").replace(f"-{os.getpid()}-", f"-{host_pid}-", 1)
        try:
            os.rename(self.shm / name, SHM_DIR / fresh)  # out of the cell's reach: checked after
            st = os.lstat(SHM_DIR / fresh)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                os.unlink(SHM_DIR / fresh)
                log.warning("a sandboxed worker named %s as its segment, which is not a plain file", name)
                return ""
            os.chown(SHM_DIR / fresh, os.getuid(), os.getgid(), follow_symlinks=False)
        except OSError as exc:
            log.warning("could not take segment %s from a sandboxed worker: %s", name, exc)
            return ""
        return fresh

    def close(self) -> bool:
        """After the worker is gone (its home stays: it is the session's directory). False while
        its cgroup still holds a process on its way out: call again later."""
        shutil.rmtree(self.shm, ignore_errors=True)
        return self.cgroup is None or self.cgroup.remove()

    def why_ended(self) -> str:
        return self.cgroup.why_ended() if self.cgroup is not None else ""
