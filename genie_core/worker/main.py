"""A session's worker process: runs user code for one client, on one device slot.

Started by the server as `python -m genie_core.worker ENDPOINT WORKER_ID`, with
CUDA_VISIBLE_DEVICES set to the session's GPU. It talks only to its server, over a private
Unix socket; a SIGINT from the server interrupts the running cell and nothing else.
"""

from __future__ import annotations

import builtins
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, cast

import zmq

from ..crash_record import record_crashes
from ..dataplane.lent import LentMaps
from ..dataplane.segment import Segment, split
from ..errors import size_text
from ..lifeline import die_with_parent, parent_gone
from ..loop import SocketLoop
from ..protocol import Codec, Message, MessageType, contents, error_content, for_worker
from ..serialize import deserialize_namespace, serialize, serialize_namespace
from .file_requests import FileRequests
from .staging import Stager
from .streams import FLUSH_INTERVAL, OutStream, capture_fd
from .synced_code import SyncedCode

log = logging.getLogger("genie.worker")


T = MessageType
REMEMBERED_CANCELS = 100  # interrupts of requests not started yet


def _main_thread_id() -> int:
    ident = threading.main_thread().ident
    assert ident is not None  # the main thread is running: it has an id
    return ident


class Worker(FileRequests):
    def __init__(self, endpoint: str, worker_id: str, server_pid: int, lifeline: int | None = None) -> None:
        self.codec = Codec(key=None)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(endpoint)
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.loop = SocketLoop("worker")
        self.loop.add_receiver(self.sock, self._on_message)
        self.parent = os.getppid()  # the server; in a sandbox, the sandbox's init (pid 1)
        self.lifeline = lifeline
        self.loop.call_every(1.0, self._check_parent)
        self.current: str = ""  # id of the request being served
        self.synced = SyncedCode()  # the session directory's modules (%genie_sync)
        # Interrupts: the loop thread decides, under this lock, against what the main thread is doing.
        self._interrupt_lock = threading.Lock()
        self.cell = ""  # id of the execute request the main thread is in
        self.armed = False  # user code is running: a SIGINT raises KeyboardInterrupt in it
        self.interrupt_pending = False  # interrupted before its user code started
        self.cancelled: OrderedDict[str, None] = OrderedDict()  # interrupted before the worker took them
        self.queued: OrderedDict[str, None] = OrderedDict()  # cells received, not yet taken by the main thread
        self.sigints_sent = self.sigints_seen = 0  # a signal that lands just before a blocking call is resent
        self.loop.call_every(0.1, self._resend_sigint)
        self.shell: Any = None
        self.tensors: Any = None  # the remote-tensor store, made on first use
        # a reply's big bytes, for the client's data plane (a sandbox's segments are moved out of its reach)
        self.stager = Stager(self.send, keep=not os.environ.get("GENIE_SANDBOXED"))
        self.lent = LentMaps()  # the client's lent upload segments, mapped once
        self.max_tensors = int(os.environ.get("GENIE_LIMIT_SESSION_TENSORS") or 1_000_000)
        self.max_bytes = (
            int(os.environ["GENIE_LIMIT_SESSION_BYTES"]) if os.environ.get("GENIE_LIMIT_SESSION_BYTES") else None
        )

    # -- I/O (loop thread) --------------------------------------------------------------
    def _on_message(self, frames: list[zmq.Frame]) -> None:
        msg = self.codec.unpack(frames)
        if msg.type == T.INTERRUPT:  # handled here, at once: the main thread may be busy for hours
            self._interrupt(cast(contents.Interrupt, msg.content).get("request"))
            return
        if msg.type == T.EXECUTE:
            with self._interrupt_lock:
                self.queued[msg.id] = None
        self.inbox.put(msg)

    def _check_parent(self) -> None:
        """A fallback for the lifeline's SIGIO, should user code catch or ignore it, and a sandboxed
        worker's check that its server is there: bubblewrap's --die-with-parent misses a server
        that dies while bubblewrap starts (its parent-death signal is set after it runs)."""
        gone = self.lifeline is not None and parent_gone(self.lifeline)
        if gone or os.getppid() != self.parent:  # the server is gone: nobody can reach us any more
            os.killpg(os.getpgrp(), signal.SIGKILL)  # with the cell's own child processes (in a sandbox: its group)

    def _interrupt(self, target: str | None) -> None:
        """Interrupt the cell `target` (None: whichever runs). It gets a KeyboardInterrupt in its
        user code; a cell that has not started yet will not run; a finished one is left alone. With
        no cell running, None means the next cell to run (received, not yet started: sent just
        before the interrupt); those behind it still run."""
        with self._interrupt_lock:
            if self.cell and target in (None, self.cell):
                if self.armed:
                    self._send_sigint()
                else:
                    self.interrupt_pending = True  # raised as its user code starts
                return
            if target is None:
                target = next(iter(self.queued), None)
                if target is None:
                    return  # between cells: nothing to interrupt
            self.cancelled[target] = None
            while len(self.cancelled) > REMEMBERED_CANCELS:
                self.cancelled.popitem(last=False)

    def _send_sigint(self) -> None:
        self.sigints_sent += 1
        signal.pthread_kill(_main_thread_id(), signal.SIGINT)  # to the main thread: it wakes a sleep

    def _resend_sigint(self) -> None:
        """A signal that arrives between Python's last check and a blocking call (`time.sleep`
        just starting) waits for the call to end. Until our handler has seen it, send it again:
        signals coalesce, so the cell still gets one KeyboardInterrupt."""
        with self._interrupt_lock:
            if self.sigints_seen < self.sigints_sent and self.armed:
                signal.pthread_kill(_main_thread_id(), signal.SIGINT)

    def _user_code(self, running: bool) -> None:
        """The shell tells us when user code starts and stops running (see WorkerShell.run_code).
        An interrupt kept while no user code ran is raised as the next statement starts."""
        with self._interrupt_lock:
            self.armed = running
            if not running:
                return  # a pending interrupt stays pending (the cell ends it, if nothing runs after)
            pending, self.interrupt_pending = self.interrupt_pending, False
        if pending:
            self.armed = False
            raise KeyboardInterrupt

    def send(
        self, kind: MessageType, content: Mapping[str, Any], buffers: list[Any] | None = None, parent: str | None = None
    ) -> None:
        msg = Message(kind, content, buffers or [], parent=self.current if parent is None else parent)
        frames = self.codec.pack(msg)
        self.loop.call_soon(lambda: self.loop.send(self.sock, frames))

    # -- set-up ---------------------------------------------------------------------------
    def setup(self) -> None:
        def emit_stream(name: str, text: str) -> None:
            self.send(T.STREAM, contents.Stream(name=name, text=text))

        out, err = OutStream("stdout", emit_stream), OutStream("stderr", emit_stream)
        saved_err = capture_fd(2, err)
        capture_fd(1, out)
        logging.basicConfig(
            stream=os.fdopen(saved_err, "w", buffering=1), level=os.environ.get("GENIE_LOG_LEVEL", "WARNING")
        )
        sys.stdout, sys.stderr = out, err

        def flush() -> None:
            out.flush()
            err.flush()

        self.loop.call_every(FLUSH_INTERVAL, flush)
        sys.stdin = open(os.devnull)  # noqa: SIM115 - stdin for the worker's lifetime

        def no_input(prompt: object = "") -> str:
            raise RuntimeError("input() is not available in a remote cell: pass values with --push instead")

        builtins.input = no_input
        os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        from traitlets.config import Config

        from .shell import WorkerShell

        config = Config()
        config.HistoryManager.enabled = False  # no SQLite write per cell (0.4 ms); the notebook keeps the history
        self.shell = WorkerShell.instance(emit=self.send, on_user_code=self._user_code, colors="linux", config=config)
        self.shell.user_ns["__name__"] = "__main__"
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        # Runs on the main thread, maybe inside `with self._interrupt_lock` there: never take it here.
        self.sigints_seen = self.sigints_sent
        if self.armed:
            raise KeyboardInterrupt
        if self.cell:  # user code paused between two statements: the next one is interrupted
            self.interrupt_pending = True
        # anywhere else (between cells) an interrupt is dropped

    # -- requests (main thread) -----------------------------------------------------------
    def serve(self) -> None:
        """Serve requests until the server ends this process (SIGTERM, or its lifeline)."""
        self.loop.start()
        self.setup()
        self.send(
            T.READY,
            contents.Ready(
                pid=os.getpid(),
                python=sys.version.split()[0],
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            ),
            parent="",
        )
        handlers = {
            T.EXECUTE: self.on_execute,
            T.PUSH: self.on_push,
            T.PULL: self.on_pull,
            T.TENSOR_OPS: self.on_tensor_ops,
            T.FILE_STAT: self.on_file_stat,
            T.FILE_PUT: self.on_file_put,
            T.FILE_GET: self.on_file_get,
        }
        while True:
            try:
                msg = self.inbox.get()
                self.current = msg.id
                kind = for_worker(msg.type)
                handler = handlers.get(kind) if kind is not None else None
                if handler is None:
                    log.error("refused a %r message: the server does not send that to workers", msg.type)
                    self.send(
                        T.ERROR_REPLY, error_content("ProtocolError", f"a worker does not take {msg.type!r} requests")
                    )
                    continue
                try:
                    self.synced.update(cast(contents.ToWorker, msg.content).get("sync"))
                    handler(msg)
                finally:
                    self.queued.pop(msg.id, None)  # (on_execute took it: this is for a failure before that)
                self.synced.note_imports()
            except KeyboardInterrupt:
                continue  # an interrupt that arrived just as a cell ended
            # a failure of ours, or a fetch of a tensor whose op failed: report it, keep serving
            except Exception as exc:
                ename = type(exc).__name__
                if self.tensors is not None:  # (then the tensor module is loaded)
                    from .tensors import error_kind

                    ename = error_kind(exc)
                self.send(T.ERROR_REPLY, error_content(ename, str(exc), traceback.format_exc().splitlines()))

    def on_execute(self, msg: Message) -> None:
        """Run a cell; whatever happens, exactly one execute_reply goes back."""
        execute = cast(contents.Execute, msg.content)
        code = execute.get("code", "")
        silent = bool(execute.get("silent", False))
        with self._interrupt_lock:
            self.queued.pop(msg.id, None)
            cancelled = self.cancelled.pop(msg.id, False) is None
            self.cell = "" if cancelled else msg.id
            self.sigints_seen = self.sigints_sent  # nothing sent for an earlier cell is resent into this one
        if cancelled:
            error, answer = contents.interrupted_before_start()
            self.send(T.ERROR, error)
            self.send(T.EXECUTE_REPLY, answer)
            return
        reply: contents.ExecuteReply
        try:
            result = self.shell.run_cell(code, store_history=not silent, silent=silent)
            reply = contents.ExecuteReply(
                status="ok" if result.success else "error", execution_count=self.shell.execution_count - 1
            )
            failed = result.error_in_exec or result.error_before_exec
            if failed is not None:
                reply["ename"], reply["evalue"] = type(failed).__name__, str(failed)
        except KeyboardInterrupt:  # landed in IPython's own code around the cell
            self.send(T.ERROR, contents.Error(ename="KeyboardInterrupt", evalue="", traceback=["KeyboardInterrupt"]))
            reply = contents.ExecuteReply(status="error", ename="KeyboardInterrupt", evalue="")
        finally:
            with self._interrupt_lock:
                self.cell, self.armed, self.interrupt_pending = "", False, False
        sys.stdout.flush()
        sys.stderr.flush()
        self.send(T.EXECUTE_REPLY, reply)

    def on_push(self, msg: Message) -> None:
        push = cast(contents.Push, msg.content)
        buffers = msg.buffers
        ref = push.get("data")
        incoming = sum(int(n) for n in ref["sizes"]) if ref else sum(memoryview(b).nbytes for b in buffers)
        held = self.tensors.bytes_held if self.tensors is not None else 0
        if self.max_bytes is not None and held + incoming > self.max_bytes:
            if ref:
                Segment.discard(ref["segment"])  # it will not be used
            self.send(
                T.PUSH_REPLY,
                contents.PushReply(
                    status="error",
                    ename="LimitExceeded",
                    evalue=(
                        f"this push of {size_text(incoming)} would make this session hold "
                        f"{size_text(held + incoming)}; the server allows {size_text(self.max_bytes)} "
                        "(--max-session-bytes): free some (del)"
                    ),
                ),
            )
            return
        if ref:  # the bytes came by the data plane: the tensors are built on that memory, no copy
            buffers = split(Segment.adopt(ref["segment"]), [int(n) for n in ref["sizes"]])
        values = deserialize_namespace(push["values"], buffers, push.get("device"))
        # What the push replaces is freed on a thread of its own: unmapping a big old tensor
        # (256 MiB: about 0.1 s here, the GIL released) would otherwise double the push's time,
        # or the next request's.
        replaced = [self.shell.user_ns[name] for name in values if name in self.shell.user_ns]
        self.shell.user_ns.update(values)
        self.send(T.PUSH_REPLY, contents.PushReply(status="ok", names=list(values)))
        if replaced:
            threading.Thread(target=replaced.clear, name="genie-free", daemon=True).start()

    def on_pull(self, msg: Message) -> None:
        pull = cast(contents.Pull, msg.content)
        names = list(pull.get("names", []))
        missing = [n for n in names if n not in self.shell.user_ns]
        if missing:
            self.send(
                T.PULL_REPLY,
                contents.PullReply(
                    status="error", ename="NameError", evalue=f"not defined on the server: {', '.join(missing)}"
                ),
            )
            return
        each: Callable[[Any], tuple[dict[str, Any], list[Any]]] = serialize
        if "torch" in sys.modules:  # (a GPU tensor's bytes go straight where they are sent from)
            from .host_copies import serialized

            each = serialized
        metas, buffers = serialize_namespace({n: self.shell.user_ns[n] for n in names}, each=each)
        self.stager.reply(T.PULL_REPLY, contents.PullReply(status="ok", values=metas), buffers, pull)

    def on_tensor_ops(self, msg: Message) -> None:
        """Replay a client's recorded tensor ops (see genie_core.remote_tensor)."""
        if self.tensors is None:
            from .tensors import TensorExecutor

            self.tensors = TensorExecutor(self.max_tensors, self.max_bytes)
        ops = cast(contents.TensorOps, msg.content)
        frames, kept = _uploaded(msg.buffers, ops.get("data"), self.lent)
        content, buffers = self.tensors.run(frames, lent=kept is not None)
        del frames
        if kept is not None and kept():
            content["kept"] = True
        self.stager.reply(T.TENSOR_REPLY, content, buffers, ops)


def _uploaded(
    frames: list[Any], ref: contents.DataRef | None, lent: LentMaps
) -> tuple[list[Any], Callable[[], bool] | None]:
    """A tensor batch's frames: its records, then the buffers of its uploads, from the data plane
    when they came by it. In a lent segment (copied out, the client fills it again) they come with
    the test of whether the batch kept a view of them (LentMaps.buffers); in an adopted one they
    become the tensors' own memory, no copy."""
    if ref and ref.get("lent"):
        buffers, kept = lent.buffers(ref)
        return [frames[0], *buffers], kept
    if ref:
        return [frames[0], *split(Segment.adopt(ref["segment"]), [int(n) for n in ref["sizes"]])], None
    return frames, None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 4:
        raise SystemExit("usage: python -m genie_core.worker ENDPOINT WORKER_ID LIFELINE_FD SERVER_PID")
    die_with_parent(int(argv[2]))
    record_crashes()
    if os.environ.get("GENIE_SANDBOXED"):
        os.chdir(os.environ["HOME"])  # the session directory, the only one it may write
    Worker(
        argv[0], argv[1], int(argv[3]), lifeline=int(argv[2])
    ).serve()  # what it leaves in /dev/shm, its server sweeps
