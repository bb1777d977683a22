"""One client's connection to one server: the handshake, requests and their replies, heartbeats,
and noticing when the server stops answering.

Requests go out on one DEALER socket, heartbeats on a second one (so a long cell or a large
transfer never delays them); both belong to a background loop thread, which also closes them.
Callers block on the request they made, never on the socket.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import zmq

from ..errors import ConnectionLost, GenieError, LimitExceeded, ProtocolError, VersionMismatch, size_text
from ..loop import SocketLoop
from ..protocol import (
    TERMINAL,
    VERSIONS_TAG,
    Codec,
    Message,
    MessageType,
    Peer,
    contents,
    derive_key,
    error_from,
    parse,
)
from ..protocol.errors import SESSION_NOT_FOUND
from ..versions import local_versions
from . import handshake
from .options import ConnectOptions

log = logging.getLogger("genie.client")

T = MessageType
ANSWERED_WHILE_LOST = (T.HELLO, T.PING, T.OUTCOME)  # what may still be sent while the server is not answering


@dataclass
class Closed:
    """Put on a request's queue when its connection went: the error its waiter raises."""

    error: BaseException


class Request:
    """One request in flight: its replies arrive here, in order, ending with a terminal one."""

    def __init__(self, msg: Message, address: str) -> None:
        self.id = msg.id
        self.type = msg.type
        self.address = address
        self.sent = time.monotonic()
        self.summary = ""  # a few words on what it does, should it be lost
        self.background = False  # a job: it follows itself after a lost connection (client/jobs.py)
        self.data: Any = None  # where its bytes went over the data plane, for its sender to free if it fails
        # A Queue, not a SimpleQueue: on Python 3.10 to 3.12 SimpleQueue.get(timeout=...) can wait
        # forever when a signal whose handler returns lands in it, and a notebook waits here with
        # its interrupt button's handler installed (genie_jupyter/magics.py)
        self._queue: queue.Queue[Message | Closed] = queue.Queue()
        self.done = False
        # set as the terminal reply arrives (or the connection goes), before anyone waits: a data
        # plane's lent segments (dataplane/lent.py) are free again once their request is answered
        # well. Its status and `kept` only: the reply itself (its values) is its waiter's.
        self.answer: dict[str, Any] | None = None
        self.lost = False
        self.settled = threading.Event()  # set with `answer` or `lost`: a lent region's owner may wait for it

    def put(self, item: Message | Closed) -> None:
        if isinstance(item, Closed):
            self.lost = True
            self.settled.set()
        elif item.type in TERMINAL:
            content = item.content or {}
            self.answer = {"status": content.get("status"), "kept": content.get("kept")}
            self.settled.set()
        self._queue.put(item)

    def next(self, timeout: float | None = None) -> Message | None:
        """The next reply, or None after `timeout` seconds. Raises if the connection is lost."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, Closed):
            self.done = True
            raise item.error
        if item.type in TERMINAL:
            self.done = True
        if item.type == T.ERROR_REPLY:
            raise error_from(cast(contents.Failure, item.content))
        return item

    def replies(self, timeout: float | None = None) -> Iterator[Message]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no reply to {self.type} from {self.address} within {timeout} s")
            msg = self.next(timeout=left)
            if msg is not None:
                yield msg

    def wait(self, timeout: float | None = None) -> Message:
        last = None
        for msg in self.replies(timeout):
            last = msg
        assert last is not None
        return last


class Connection:
    """The sockets and the protocol of one session. What happens to the session (lost, back,
    replies nobody waits for, events) goes to the owner through the `on_*` callbacks, which run
    on the loop thread."""

    def __init__(self, host: str, port: int, token: str, options: ConnectOptions | None = None) -> None:
        self.host, self.port = host, port
        self.options = options or ConnectOptions()
        self.address = f"{host}:{port}"
        self.codec = Codec(derive_key(token))
        self.session = ""
        self.node = contents.NodeDescription()  # the server's, from its welcome
        self.slot: int | None = None
        self.lost_reason: str | None = None
        # How a lost connection is told: what the server is to the user, and the one thing to do
        # once the session is gone (a pool session names its node and says to be placed again).
        self.serving = f"genie server at {self.address}"
        self.when_gone = "run %genie_init (or genie_core.init) again to start a new session"
        self.pooled = False  # a pool's session: when its server closes the connection, the session is gone
        self.session_gone = False  # the server said it no longer has our session
        self.closing = False  # we asked the server to end the session: its going is no loss
        self.rtt: float | None = None
        self.closed = False
        self.pending: dict[str, Request] = {}
        self.last_heard = time.monotonic()
        self.on_lost: Callable[[str, list[Request]], None] = lambda reason, cut: None
        self.on_back: Callable[[], None] = lambda: None
        self.on_orphan: Callable[[Message], None] = lambda msg: None  # a reply nobody waits for any more
        self.on_unsolicited: Callable[[Message], None] = lambda msg: None  # events and readings
        self.on_session_gone: Callable[[str], None] = lambda why: None
        self._seq = itertools.count(1)
        self._send_locks: dict[Any, threading.Lock] = {}  # one per socket: a big request never holds up a ping
        self._handshake_error: GenieError | None = None  # set by the loop thread as a handshake fails
        self._loop: SocketLoop | None = None

    # -- connecting -------------------------------------------------------------------------
    def connect(self) -> contents.Welcome:
        """Handshake; returns the server's welcome."""
        start = time.monotonic()
        handshake.probe_server(self.host, self.port, self.options.timeout, encrypted=bool(self.options.curve))
        ctx = zmq.Context()
        self._loop = SocketLoop("client", context=ctx)  # it closes the sockets and ends the context
        endpoint = f"tcp://[{self.host}]:{self.port}" if ":" in self.host else f"tcp://{self.host}:{self.port}"
        self.main = self._dealer(ctx)
        self.heartbeat = self._dealer(ctx)
        self._send_locks = {self.main: threading.Lock(), self.heartbeat: threading.Lock()}
        self._loop.add_receiver(self.main, self._on_message, batch=256)
        self._loop.add_receiver(self.heartbeat, self._on_message, batch=256)
        # Monitors before connecting: a handshake can fail before a later monitor would see it.
        self._loop.add_socket(
            self.main.get_monitor_socket(handshake.HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED), self._on_connection_event
        )
        if self.options.enable_heartbeat:  # a crashed server closes its connections: notice at once
            self._loop.add_socket(self.heartbeat.get_monitor_socket(zmq.EVENT_DISCONNECTED), self._on_disconnect)
        self._loop.on_exit.append(self._disable_monitors)
        self.main.connect(endpoint)
        self.heartbeat.connect(endpoint)
        self._loop.start()
        hello = Message(
            T.HELLO,
            contents.Hello(
                client=contents.ClientDescription(
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    user=os.environ.get("USER", ""),
                    purpose=self.options.purpose,
                ),
                # pings come, and events go, there only
                heartbeat=cast(bytes, self.heartbeat.getsockopt(zmq.ROUTING_ID)).hex(),
                versions=local_versions(),
                name=self.options.session_name,
            ),
        )
        left = self.options.timeout - (time.monotonic() - start)
        try:
            request = self.request(hello)
            if self._handshake_error is not None and self.pending.pop(request.id, None) is not None:
                raise self._handshake_error  # it failed before the hello was even registered
            welcome = cast(contents.Welcome, request.wait(timeout=max(left, 0.1)).content)
        except TimeoutError:
            self.close()
            raise handshake.unanswered(self.address, self.options.timeout) from None
        except BaseException:
            self.close()
            raise
        self.session = welcome["session"]
        self.node = welcome.get("node", contents.NodeDescription())
        self.slot = welcome.get("slot")
        self.last_heard = time.monotonic()
        if self.options.enable_heartbeat:
            self._loop.call_every(self.options.heartbeat_interval, self._heartbeat)
        return welcome

    def _dealer(self, ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # harmless for IPv4 addresses
        if self.options.curve:
            from ..encryption import secure_client

            secure_client(sock, self.options.curve)
        return sock

    def _on_connection_event(self, monitor: zmq.Socket[Any]) -> None:
        """The control connection's events. During the handshake, a failure (CURVE keys,
        mechanism) or a closed connection is final: say why at once instead of waiting for the
        timeout. After it, a closed connection loses what was in flight on it (zmq reconnects by
        itself): those requests fail now, and "did it run?" asks about them once it is back."""
        from zmq.utils.monitor import recv_monitor_message

        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            if self.session:
                if event["event"] == zmq.EVENT_DISCONNECTED and not self.closed:
                    self.mark_lost(self._closed_by_server())
                continue
            if self._handshake_error is not None:
                continue  # the first event says why; a disconnect follows every failed handshake
            error = handshake.handshake_failed(event["event"], event["value"], self.address, bool(self.options.curve))
            self._handshake_error = error  # first, then the hello: connect() checks in the other order
            for request in [r for r in list(self.pending.values()) if r.type == T.HELLO]:
                self.pending.pop(request.id, None)
                request.put(Closed(error))

    def _disable_monitors(self) -> None:
        """On the loop thread as it ends: stop socket monitors before their sockets close."""
        for sock in (self.main, self.heartbeat):
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass

    # -- requests and replies -----------------------------------------------------------
    def request(self, msg: Message, *, heartbeat: bool = False, background: bool = False) -> Request:
        """Send `msg` (on the heartbeat connection if asked); its replies arrive on the Request.
        `background`: a job's, which follows itself after a lost connection (client/jobs.py)."""
        if self.closed or self._loop is None:
            raise ConnectionLost(f"the connection to {self.address} is closed")
        request = Request(msg, self.address)
        request.background = background
        # Registered first, then checked: a connection lost meanwhile either sees it, or is seen here.
        self.pending[msg.id] = request
        if self.lost_reason is not None and msg.type not in ANSWERED_WHILE_LOST:
            self.pending.pop(msg.id, None)
            raise ConnectionLost(self.lost_reason)
        target = self.heartbeat if heartbeat else self.main
        msg.session = self.session
        limits = self.node.get("limits")
        limit = limits.get("message_bytes") if limits else None
        loop = self._loop
        with self._send_locks[target]:  # sequence numbers must reach each socket in order
            msg.seq = next(self._seq)
            frames = self.codec.pack(msg)
            size = sum(memoryview(f).nbytes for f in frames)
            if limit is not None and size > limit:  # the server would drop the connection instead
                self.pending.pop(msg.id, None)
                raise LimitExceeded(
                    f"this {msg.type} message of {size_text(size)} is over the {size_text(limit)} the server "
                    f"at {self.address} takes in one message (GENIE_MAX_MESSAGE_BYTES there)"
                )
            loop.call_soon(lambda: loop.send(target, frames))
        return request

    def forget(self, request: Request) -> None:
        """Stop waiting for `request`: its replies, should they come, go to `on_orphan`."""
        self.pending.pop(request.id, None)

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = self.codec.unpack(frames)
        except ProtocolError as exc:
            self._on_unauthenticated(frames, exc)
            return
        if parse(msg.type, Peer.SERVER) is None:
            log.warning("dropped a %r message from %s: servers do not send that", msg.type, self.address)
            return
        self.last_heard = time.monotonic()
        if msg.type == T.PONG:
            self.rtt = time.monotonic() - getattr(self.pending.get(msg.parent), "sent", time.monotonic())
        error = cast(contents.Failure, msg.content) if msg.type == T.ERROR_REPLY else None
        session_unknown = error is not None and error.get("ename") == SESSION_NOT_FOUND
        if self.lost_reason is not None and self.session and not self.session_gone and not session_unknown:
            self.lost_reason = None
            self.on_back()
        if not msg.parent:
            self.on_unsolicited(msg)
            return
        request = self.pending.get(msg.parent)
        if request is not None and msg.type in TERMINAL:
            self.pending.pop(msg.parent, None)
        if request is None:
            self.on_orphan(msg)
        if error is not None and session_unknown:
            self._session_ended(str(error.get("evalue", "session not found")))
        if request is not None:
            request.put(msg)

    def _on_unauthenticated(self, frames: list[Any], exc: ProtocolError) -> None:
        if len(frames) == 2 and bytes(frames[0]) == VERSIONS_TAG:
            self._on_other_protocol(frames[1])
            return
        try:
            msg = Codec(None).unpack(frames, verify=False)
        except ProtocolError:
            log.warning("dropped a malformed message from %s: %s", self.address, exc)
            return
        request = self.pending.pop(msg.parent, None)
        if msg.type == T.AUTH_FAILED and request is not None and request.type == T.HELLO:
            request.put(Closed(handshake.wrong_token(self.address)))
        else:
            log.warning("dropped an unauthenticated message from %s: %s", self.address, exc)

    def _on_other_protocol(self, frame: Any) -> None:
        """The server speaks another protocol version and said which: fail the hello, naming both."""
        problems = handshake.version_problems(frame, self.address)
        if not problems:
            log.warning("dropped a malformed version answer from %s", self.address)
            return
        for request in [r for r in list(self.pending.values()) if r.type == T.HELLO]:
            self.pending.pop(request.id, None)
            request.put(Closed(VersionMismatch("; ".join(problems))))

    # -- liveness -------------------------------------------------------------------------
    def _on_disconnect(self, monitor: zmq.Socket[Any]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED and self.session and not self.closed:
                self.mark_lost(self._closed_by_server())

    def _closed_by_server(self) -> str:
        """What a lost connection says when the server closed it (whichever monitor saw it first)."""
        return f"connection to {self.serving} lost: the server closed the connection " + (
            f"(the session's process or node died); {self.when_gone}" if self.pooled else "(it stopped or crashed)"
        )

    def _heartbeat(self) -> None:
        silent_for = time.monotonic() - self.last_heard
        if self.lost_reason is None and silent_for > self.options.heartbeat_timeout:
            self.mark_lost(f"connection to {self.serving} lost: no heartbeat for {silent_for:.1f} s")
        for rid, req in list(self.pending.items()):
            if req.type == T.PING and time.monotonic() - req.sent > self.options.heartbeat_timeout:
                self.pending.pop(rid, None)
        try:
            self.request(Message(T.PING), heartbeat=True)
        except ConnectionLost:
            pass

    def mark_lost(self, reason: str) -> None:
        """The server stopped answering: every request in flight fails now (the owner learns
        which, to ask about them later); pings go on, and the first answer brings it back. Not
        while we close the session: its server may end as it answers (a pool session's does)."""
        if self.lost_reason is not None or self.closing:
            return
        self.lost_reason = reason
        log.warning(reason)
        # Cells are cut; pings and "what became of them?" wait for their own answers, which may come
        # when the link heals (the server answers the question even for a session it has ended).
        cut = [r for r in list(self.pending.values()) if r.type not in (T.PING, T.OUTCOME)]
        for request in cut:
            self.pending.pop(request.id, None)
        self.on_lost(reason, cut)

    def _session_ended(self, why: str) -> None:
        """The server no longer knows our session (it expired while we were cut off, or the
        server restarted): this connection is done."""
        if self.lost_reason is None:
            self.mark_lost(why)
        self.lost_reason = f"{why}; {self.when_gone}"
        if not self.session_gone:
            self.session_gone = True
            self.on_session_gone(why)

    def session_lost(self, why: str) -> None:
        """Someone else (a pool) knows the session is gone: end it as if the server had said so,
        on the connection's own thread."""
        if self._loop is not None and not self.closed:
            self._loop.call_soon(lambda: self._session_ended(why))

    def session_closed(self) -> None:
        """We ended the session ourselves: a heartbeat answered "unknown session" from now on is
        expected, not a loss to warn about."""
        self.session_gone = True
        self.lost_reason = self.lost_reason or "the session was closed"

    @property
    def connected(self) -> bool:
        return bool(self.session) and self.lost_reason is None and not self.closed

    def close(self, timeout: float = 2.0) -> None:
        """Fail what is pending, stop the loop (it closes the sockets, then ends the context)."""
        if self.closed:
            return
        self.closed = True
        for request in list(self.pending.values()):
            request.put(Closed(ConnectionLost(f"the connection to {self.address} was closed")))
        self.pending.clear()
        if self._loop is not None:
            self._loop.stop(timeout=timeout)
