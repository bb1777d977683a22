"""Worker processes: one per session and device slot, a warm spare started ahead of need, and
the requests the server hands them. A worker runs user code; the server never does.

Each worker holds the read end of a lifeline of its own (see genie_core.lifeline), leads its
own process group, and is told apart from other processes by its argv (for the start-up sweep).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import zmq

from ..config import runtime_dir_for
from ..crash_record import ENV as CRASH_FD
from ..crash_record import CrashRecord, innermost
from ..dataplane.filling import Fillings
from ..dataplane.segment import sweep_worker
from ..lifeline import Lifeline
from ..nodes import GPUInfo
from ..protocol import TERMINAL, Codec, Message, MessageType, Peer, contents, error_content, parse
from ..sandbox import Sandbox, SandboxedWorker
from ..sandbox.uids import UidLease
from .sessions import Session

log = logging.getLogger("genie.server")

CPU = -1  # the device slot of a worker that uses no GPU
T = MessageType


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


def _runtime_dir_of(pid: str) -> Path | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    environ = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)
    if environ.get("GENIE_SANDBOXED"):
        return None  # ends with its bwrap, which ends with its server (--die-with-parent)
    return runtime_dir_for(environ)


def sweep_orphans() -> int:
    """End the workers of servers that died without ending them (and their process groups): those
    of this user's servers that shared this server's runtime folder (another installation's, or
    another test run's, are theirs to sweep). The lifeline makes this rare; a worker that ignored
    SIGIO is one way to need it."""
    ended = 0
    ours = runtime_dir_for(os.environ)
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
        if parent != int(argv[6]) and _runtime_dir_of(proc_dir.name) == ours:
            try:
                os.killpg(int(proc_dir.name), signal.SIGKILL)  # a worker leads its own process group
                ended += 1
            except OSError:
                pass
    return ended


def _free_home(home: tuple[Path, UidLease | None]) -> None:
    shutil.rmtree(home[0], ignore_errors=True)
    if home[1] is not None:
        home[1].release()


class WorkerProcess:
    def __init__(
        self,
        worker_id: str,
        slot: int,
        endpoint: str,
        limits: contents.Limits | None = None,
        sandboxed: SandboxedWorker | None = None,
    ) -> None:
        self.id = worker_id
        self.slot = slot
        self.sandboxed = sandboxed
        env = dict(os.environ)
        for name, value in (limits or {}).items():  # the worker enforces the session limits itself
            env[f"GENIE_LIMIT_{name.upper()}"] = "" if value is None else str(value)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so CUDA's GPU N is NVML's (and nvidia-smi's) GPU N
        env["CUDA_VISIBLE_DEVICES"] = "" if slot == CPU else str(slot)
        env["GENIE_WORKER_ID"] = worker_id
        env.pop("GENIE_TOKEN", None)  # user code has no business with the server's token
        self.lifeline = Lifeline()  # it ends when we do, however we end, or when we let it go
        self.crash = CrashRecord()  # where it was, should a fatal signal end it
        env[CRASH_FD] = str(self.crash.fd)
        argv = [sys.executable, "-m", "genie_core.worker", endpoint, worker_id, str(self.lifeline.fd), str(os.getpid())]
        if sandboxed is not None:
            argv, env = sandboxed.command(argv, env)
        try:
            self.proc = self.lifeline.start(
                argv,
                pass_fds=(self.crash.fd,),
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C at the server's terminal is the server's, not the cell's
            )
        except BaseException:
            self.crash.close()
            raise
        self.started = time.monotonic()
        self.python_pid = 0
        self.ready = False
        self.session: Session | None = None
        self.own_home: tuple[Path, UidLease | None] | None = None  # a sandboxed spare's, until a session takes it
        self.waiting: list[Message] = []  # requests that arrived before the worker was ready
        self.inflight: dict[str, Message] = {}  # request id -> request
        self.stop_requested: float | None = None

    @property
    def pid(self) -> int:
        """The worker's Python process (a sandboxed one's is bubblewrap's grandchild; until it is
        ready, bubblewrap's own). Its process group is always `proc.pid`'s."""
        return self.python_pid or self.proc.pid

    def find_python(self) -> None:
        """A sandboxed worker's own pid, as this host sees it (its cells see their namespace's)."""
        import psutil

        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                if child.cmdline()[1:3] == ["-m", "genie_core.worker"]:
                    self.python_pid = child.pid
        except psutil.Error:
            pass

    def alive(self) -> bool:
        return self.proc.poll() is None

    def returncode(self) -> int | None:
        """As Popen has it: negative for a signal. bubblewrap passes a sandboxed worker's death
        by signal N on as the shell does, exit code 128 + N."""
        code = self.proc.returncode
        if self.sandboxed is not None and code is not None and 128 < code < 128 + 65:
            return -(code - 128)
        return code

    def busy(self) -> bool:
        return any(m.type == "execute" for m in self.inflight.values())

    def stop(self) -> None:
        """End it, and the processes its cells started, now: its lifeline closes (SIGIO to its
        process group, which works while it holds the GIL in a long C call) and SIGTERM follows
        (for user code that ignores SIGIO); `reap` escalates to SIGKILL if it lingers."""
        if self.stop_requested is None:
            self.stop_requested = time.monotonic()
            self.let_go()
            self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)

    def let_go(self) -> None:
        """Close its lifeline (see `stop`); once it has ended, this only frees the pipe."""
        self.lifeline.close()

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

    def info(self) -> contents.WorkerInfo:
        public = hashlib.sha256(self.id.encode()).hexdigest()[:16]  # the id itself opens its socket
        return {"id": public, "pid": self.pid, "slot": self.slot, "ready": self.ready, "busy": self.busy()}


Reply = Callable[[Session, Message], None]  # a worker's message, passed on to its session's client


class WorkerPool:
    """The workers of one server: a spare per slot kept warm, each session's workers by slot, and
    the ones ending. Requests go to a session's worker (started if needed); its messages come back
    through `reply`; a worker that dies fails what it was running, naming why."""

    def __init__(
        self,
        *,
        limits: contents.Limits,
        gpus: list[GPUInfo],
        spares: int,
        reply: Reply,
        sessions: dict[str, Session],
        sandbox: Sandbox | None = None,
        max_message_bytes: int = 0,
        fillings: Fillings,
    ) -> None:
        self.limits, self.sandbox = limits, sandbox
        self.fillings = fillings  # segments workers fill after their replies: the data ports' own (one object)
        self.gpus, self.spare_count, self.reply = gpus, spares, reply
        self.sessions = sessions  # the live sessions (the session table's), to balance slots
        self.max_message_bytes = max_message_bytes  # sandboxed cells can reach the workers' socket
        self.sock: zmq.Socket[Any] | None = None  # bound by listen()
        self.folder: Path | None = None  # 0700: the workers' socket, unsandboxed sessions' directories
        self.endpoint, self.address = "", ""
        self.home_root: Path | None = None  # sandboxed sessions' directories (0711)
        self.homes: dict[str, tuple[Path, UidLease | None]] = {}  # sandboxed session -> its directory and uid
        self.retiring: list[tuple[tuple[Path, UidLease | None], list[WorkerProcess]]] = []  # ended sessions'
        self.closing: list[SandboxedWorker] = []  # sandboxes whose cgroups were still busy
        self.codec = Codec(key=None)  # a private Unix socket in a 0700 folder
        self.workers: dict[str, WorkerProcess] = {}
        self.spares: list[WorkerProcess] = []
        self.dying: list[WorkerProcess] = []
        self.assigned: dict[str, dict[int, WorkerProcess]] = {}  # session id -> its workers by slot

    def listen(self, ctx: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
        """Bind the workers' socket in a new 0700 folder; `address` is the server's, for messages.
        Sandboxed: the folder is hidden from cells but its socket is theirs to reach, and sessions'
        directories go in a folder of their own that their uids may pass through (0711) but not list."""
        self.address = address
        self.folder = Path(tempfile.mkdtemp(prefix="genie-"))
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes or -1)
        self.endpoint = f"ipc://{self.folder}/workers"
        self.sock.bind(self.endpoint)
        if self.sandbox is not None:
            self.sandbox.hide(self.folder)
            self.sandbox.expose(self.folder / "workers")
            os.chmod(self.folder / "workers", 0o666)  # sessions' uids; the folder stays 0700
            self.home_root = Path(tempfile.mkdtemp(prefix="genie-homes-"))
            os.chmod(self.home_root, 0o711)
            self.sandbox.hide(self.home_root)
        return self.sock

    def session_root(self, session: Session) -> Path:
        """Where the session's directory is: a sandboxed session's home, else one in our folder."""
        assert self.folder is not None
        return self.home(session) or self.folder / f"session-{session.id[:16]}"

    def remove_folders(self) -> None:
        for folder in (self.folder, self.home_root):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    # -- slots ----------------------------------------------------------------------------
    def next_slot(self) -> int:
        """The GPU with the fewest sessions (the CPU on a server without GPUs)."""
        if not self.gpus:
            return CPU
        load = {g.index: 0 for g in self.gpus}
        for s in self.sessions.values():
            if s.slot in load:
                load[s.slot] += 1
        return int(min(load, key=lambda i: (load[i], i)))

    def slot_for(self, session: Session, gpu: Any) -> tuple[int, str]:
        """The slot a request asks for (None: the session's own), or why it cannot have it."""
        if gpu is None:
            return session.slot, ""
        try:
            index = int(gpu)
        except (TypeError, ValueError):
            return CPU, f"invalid GPU {gpu!r}: expected an index"
        if not self.gpus:
            if index == 0:
                return CPU, ""
            return CPU, f"GPU {index} does not exist: the server at {self.address} has no GPU (use --gpu 0, its CPU)"
        indices = [g.index for g in self.gpus]
        if index not in indices:
            return CPU, f"GPU {index} does not exist on {self.address}: it has GPUs {', '.join(map(str, indices))}"
        return index, ""

    # -- processes ------------------------------------------------------------------------
    def _spawn(self, slot: int, session: Session | None = None) -> WorkerProcess:
        worker_id = os.urandom(8).hex()
        sandboxed, own = None, None
        if self.sandbox is not None:
            assert self.home_root is not None
            home = self.homes.get(session.id) if session is not None else None
            if home is None:  # a spare: its home and uid become those of the session that takes it
                own = home = (self.home_root / f"home-{worker_id}", self.sandbox.lease())
            gpu = next((g for g in self.gpus if g.index == slot), None)
            uid = home[1].uid if home[1] is not None else None
            sandboxed = SandboxedWorker(self.sandbox, worker_id, home[0], uid, gpu)
        try:
            worker = WorkerProcess(worker_id, slot, self.endpoint, self.limits, sandboxed)
        except BaseException:
            if sandboxed is not None:
                sandboxed.close()
            if own is not None:
                _free_home(own)
            raise
        worker.own_home = own
        self.workers[worker.id] = worker
        return worker

    def _take(self, slot: int, session: Session) -> WorkerProcess:
        """A spare for the slot (its home becomes the session's), or a fresh worker (in the
        session's home, when it has one)."""
        if session.id not in self.homes:
            for w in self.spares:
                if w.slot == slot and w.alive():
                    self.spares.remove(w)
                    self._adopt_home(w, session)
                    return w
        worker = self._spawn(slot, session)
        self._adopt_home(worker, session)
        return worker

    def _adopt_home(self, worker: WorkerProcess, session: Session) -> None:
        if worker.own_home is not None:
            self.homes[session.id], worker.own_home = worker.own_home, None

    def owner(self, session: Session) -> int | None:
        """The uid a sandboxed session runs as (None: the server's own)."""
        home = self.homes.get(session.id)
        return home[1].uid if home is not None and home[1] is not None else None

    def home(self, session: Session) -> Path | None:
        """A sandboxed session's directory: its first worker's home (started now if need be)."""
        if self.sandbox is None:
            return None
        if session.id not in self.homes:
            workers = self.assigned.setdefault(session.id, {})
            worker = workers[session.slot] = self._take(session.slot, session)
            worker.session = session
            self.refill_spares()
        return self.homes[session.id][0]

    def refill_spares(self) -> None:
        slot = self.next_slot()
        self.spares = [w for w in self.spares if w.alive()]
        if self.spare_count > 0 and not any(w.slot == slot for w in self.spares):
            if len(self.spares) >= self.spare_count:
                old = self.spares.pop(0)
                self.workers.pop(old.id, None)
                old.stop()
                self.dying.append(old)
            self.spares.append(self._spawn(slot))

    def of(self, session: Session) -> dict[int, WorkerProcess]:
        """The session's workers, by slot."""
        return self.assigned.get(session.id, {})

    def worker_pids(self, session_id: str) -> list[int] | None:
        """For the data listeners (their threads): the pids of a live session's workers, else None."""
        if session_id not in self.sessions:
            return None
        return [w.pid for w in list(self.assigned.get(session_id, {}).values())]

    def release(self, session: Session) -> None:
        """The session ended: its workers end (and so does what their cells started)."""
        ending = list(self.assigned.pop(session.id, {}).values())
        for worker in ending:
            self.workers.pop(worker.id, None)
            worker.stop()
            self.dying.append(worker)
        home = self.homes.pop(session.id, None)
        if home is not None:  # its files go, and its uid is free again, once its workers are gone
            self.retiring.append((home, ending))

    def stop_all(self, grace: float = 3.0) -> None:
        procs = list(self.workers.values()) + self.spares + self.dying
        for w in procs:
            w.stop()
        deadline = time.monotonic() + grace
        for w in procs:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
                w.proc.wait()
            w.reap()
            self._gone(w)
        for home in [*self.homes.values(), *(h for h, _ in self.retiring)]:
            _free_home(home)
        self.homes.clear()
        self.retiring.clear()
        for sandboxed in self.closing:
            sandboxed.close()

    def _gone(self, worker: WorkerProcess) -> None:
        """What a worker that has ended leaves behind: staged segments, its sandbox, a spare's home."""
        worker.let_go()
        worker.crash.close()
        self.fillings.worker_gone(worker.pid, f"the session's worker process (pid {worker.pid}) ended while staging")
        sweep_worker(worker.pid)
        if worker.sandboxed is not None and not worker.sandboxed.close():
            self.closing.append(worker.sandboxed)  # its cgroup empties a moment later
        if worker.own_home is not None:
            _free_home(worker.own_home)
            worker.own_home = None

    # -- requests -------------------------------------------------------------------------
    def route(self, session: Session, msg: Message) -> str:
        """Hand a request to the session's worker of its slot; "" or why it cannot go."""
        slot, problem = self.slot_for(session, cast(contents.ToWorker, msg.content).get("gpu"))
        if problem:
            return problem
        workers = self.assigned.setdefault(session.id, {})
        worker = workers.get(slot)
        fresh = worker is None
        if worker is None:
            worker = workers[slot] = self._take(slot, session)
            worker.session = session
        worker.inflight[msg.id] = msg
        if worker.ready:
            self._forward(worker, msg)
        else:
            worker.waiting.append(msg)
        if fresh:  # after the request is on its way: starting a process takes a few milliseconds
            self.refill_spares()
        return ""

    def interrupt(self, session: Session, target: str | None) -> tuple[list[Message], int]:
        """Interrupt a cell (None: whichever runs, or else the next to run). A cell still waiting for
        its worker to start is taken back (returned: the caller answers it; it never runs); ready
        workers are told."""
        cancelled, forwarded = [], 0
        for worker in self.of(session).values():
            waiting = next((m for m in worker.waiting if m.type == T.EXECUTE and target in (None, m.id)), None)
            if waiting is not None:
                worker.waiting.remove(waiting)
                worker.inflight.pop(waiting.id, None)
                cancelled.append(waiting)
            if worker.ready:
                self._forward(worker, Message(T.INTERRUPT, contents.Interrupt(request=target)))
                forwarded += 1
        return cancelled, forwarded

    def _forward(self, worker: WorkerProcess, msg: Message) -> None:
        ref = cast(contents.ToWorker, msg.content).get("data")
        if worker.sandboxed is not None and isinstance(ref, dict) and isinstance(ref.get("segment"), str):
            worker.sandboxed.move_in(ref["segment"])
        frames = self.codec.pack(Message(msg.type, msg.content, msg.buffers, id=msg.id))
        assert self.sock is not None
        self.sock.send_multipart([worker.id.encode(), *frames], copy=False)

    def on_message(self, frames: list[zmq.Frame]) -> None:
        """A worker's message (loop thread): readiness, or an output or reply for its client."""
        wid = frames[0].bytes.decode(errors="replace")
        worker = self.workers.get(wid)
        if worker is None:
            return
        try:
            msg = self.codec.unpack(frames[1:])
        except Exception as exc:
            log.error("worker %s sent a malformed message: %s", wid, exc)
            return
        kind = parse(msg.type, Peer.WORKER)
        if kind is None:
            log.error("refused a %r message from worker %s, which may not send it", msg.type, wid)
            return
        if kind is T.READY:
            worker.ready = True
            if worker.sandboxed is not None:
                worker.find_python()
            for waiting in worker.waiting:
                self._forward(worker, waiting)
            worker.waiting.clear()
            return
        if kind is T.STAGING:  # (after its reply: the request is no longer in flight)
            said = cast(contents.Staging, msg.content)
            self.fillings.advance(worker.pid, int(said["filled"]), said.get("ename", ""), said.get("evalue", ""))
            return
        session = worker.session
        if worker.inflight.get(msg.parent) is None or session is None or session.id not in self.sessions:
            return
        ref = cast(contents.Staged, msg.content).get("data")  # a pull's or a download's bytes, staged
        if worker.sandboxed is not None and isinstance(ref, dict) and isinstance(ref.get("segment"), str):
            ref["segment"] = worker.sandboxed.move_out(ref["segment"], worker.pid)
        if isinstance(ref, dict) and ref.get("filling") and ref.get("segment"):
            total = sum(int(n) for n in ref.get("sizes", []))
            reusable = worker.sandboxed is None and bool(ref.get("reused"))  # (a sandbox's is moved out)
            self.fillings.begin(worker.pid, str(ref["segment"]), total, session.id, reusable)
        if kind in TERMINAL:
            worker.inflight.pop(msg.parent, None)
            session.finished(msg.parent, cast(contents.Failure, msg.content))  # a reply, or an error reply
        self.reply(session, msg)

    def housekeeping(self) -> None:
        """Notice workers that died (failing what they ran, saying why) and reap ending ones."""
        for worker in list(self.workers.values()):
            if worker.alive():
                continue
            self.workers.pop(worker.id, None)
            worker.reap()
            limit = worker.sandboxed.why_ended() if worker.sandboxed is not None else ""
            why = limit or describe_exit(worker.returncode(), worker.pid)
            stack = worker.crash.stack()
            frame = innermost(stack)
            if frame:
                why += f", in {frame}"
            self._gone(worker)
            log.warning("worker %s (pid %d) %s", worker.id, worker.pid, why + "".join(f"\n  {s}" for s in stack))
            session = worker.session
            if session is not None and self.of(session).get(worker.slot) is worker:
                del self.assigned[session.id][worker.slot]
                for request in list(worker.inflight.values()) + worker.waiting:
                    content = error_content(
                        "WorkerDied",
                        f"the session's worker process (pid {worker.pid}) {why} while running "
                        "this request; its variables are lost, and the next request starts a fresh worker",
                    )
                    session.finished(request.id, content)
                    self.reply(session, Message(T.ERROR_REPLY, content, parent=request.id))
        still = []
        for w in self.dying:
            if w.reap():
                self._gone(w)
            else:
                still.append(w)
        self.dying = still
        self.closing = [sandboxed for sandboxed in self.closing if not sandboxed.close()]
        retiring = []
        for home, workers in self.retiring:
            if any(w.proc.poll() is None for w in workers):
                retiring.append((home, workers))
            else:
                _free_home(home)
        self.retiring = retiring
        if self.spare_count and not any(w.alive() for w in self.spares):
            self.refill_spares()
