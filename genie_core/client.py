"""The client side of a connection to one genie server.

Requests go out on one DEALER socket, heartbeats on a second one (so a long cell or a large
transfer never delays them); both belong to a background I/O thread. Callers block on the
request they made, never on the socket.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import zmq

from .errors import (AuthenticationError, ConnectionFailed, ConnectionLost, GenieError, LimitExceeded, ProtocolError, size_text)
from .events import ClusterEvent, EventBus, EventType, Severity
from .lost_requests import KEEP_OUTPUT, LostRequest
from .loop import SocketLoop
from .monitoring.health import Grade, HealthCheck, HealthReport, worst
from .nodes import NodeInfo
from .protocol import RUNS, TERMINAL, Codec, Message, MessageType, Peer, derive_key, error_from, error_text, parse
from .serialize import deserialize_namespace, serialize_namespace
from .transport.base import DATA_THRESHOLD, InlineTransport
from .transport.discovery import BackendReport, discover
from .transport.segment import Segment

log = logging.getLogger("genie.client")

HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
KEEP_LOST = 100  # lost requests remembered
# The start of a ZMTP 3 greeting (signature, major version): a ZMTP server answers it with its
# whole 64-byte greeting, which names its security mechanism at bytes 12-31.
ZMTP_SIGNATURE = b"\xff" + bytes(8) + b"\x7f\x03"
GREETING_BYTES = 64


@dataclass
class _Closed:
    error: BaseException


class Request:
    """One request in flight: its replies arrive here, in order, ending with a terminal one."""

    def __init__(self, client: "Client", msg: Message) -> None:
        self.client = client
        self.id = msg.id
        self.type = msg.type
        self.sent = time.monotonic()
        self.summary = ""  # a few words on what it does, should it be lost
        self._queue: queue.SimpleQueue[Message | _Closed] = queue.SimpleQueue()
        self.done = False

    def _put(self, item: Message | _Closed) -> None:
        self._queue.put(item)

    def next(self, timeout: float | None = None) -> Message | None:
        """The next reply, or None after `timeout` seconds. Raises if the connection is lost."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, _Closed):
            self.done = True
            raise item.error
        if item.type in TERMINAL:
            self.done = True
        if item.type == MessageType.ERROR_REPLY:
            raise error_from(item.content)
        return item

    def replies(self, timeout: float | None = None) -> Iterator[Message]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no reply to {self.type} from {self.client.address} within {timeout} s")
            msg = self.next(timeout=left)
            if msg is not None:
                yield msg

    def wait(self, timeout: float | None = None) -> Message:
        last = None
        for last in self.replies(timeout):
            pass
        assert last is not None
        return last


class Client:
    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        timeout: float = 30.0,
        enable_heartbeat: bool = True,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 4.0,
        events: EventBus | None = None,
        purpose: str = "session",
        data_port: int | None = None,
        curve: dict[str, str] | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.address = f"{host}:{port}"
        self.codec = Codec(derive_key(token))
        self.timeout = timeout
        self.enable_heartbeat = enable_heartbeat
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.purpose = purpose  # "probe" for one-shot tools like `genie status`
        self.data_port = data_port  # overrides the data port the server advertises (tunnels, relays)
        self.curve = curve  # keys from the connection file of a server started with --encrypt
        self.events = events or EventBus()
        self.metrics: NodeInfo | None = None  # the newest snapshot the server pushed
        self.server_health: HealthReport | None = None
        self.session = ""
        self.node: dict[str, Any] = {}
        self.slot: int | None = None
        self.lost_reason: str | None = None
        self.transport: Any = InlineTransport()  # the data plane; chosen by select_backend()
        self.backend_report: BackendReport | None = None
        self._transfer_lock = threading.Lock()
        self.rtt: float | None = None
        self.lost_requests: dict[str, LostRequest] = {}  # cut off by a lost connection; see LostRequest
        self._handshake_error: GenieError | None = None  # set by the loop thread as a handshake fails
        self._session_gone = False  # the server said it no longer has our session
        self._pending: dict[str, Request] = {}
        self._seq = itertools.count(1)
        self._send_locks: dict[Any, threading.Lock] = {}  # one per socket: a big request never holds up a ping
        self._last_heard = time.monotonic()
        self._ctx: zmq.Context | None = None
        self._loop: SocketLoop | None = None
        self._closed = False

    # -- connecting -----------------------------------------------------------------------
    def connect(self) -> "Client":
        start = time.monotonic()
        self._probe_server()
        ctx = self._ctx = zmq.Context()
        self._loop = SocketLoop("client", context=ctx)  # it closes the sockets and ends the context
        endpoint = f"tcp://[{self.host}]:{self.port}" if ":" in self.host else f"tcp://{self.host}:{self.port}"
        self._main = self._dealer(ctx, self.curve)
        self._hb = self._dealer(ctx, self.curve)
        self._send_locks = {self._main: threading.Lock(), self._hb: threading.Lock()}
        self._loop.add_socket(self._main, self._on_readable)
        self._loop.add_socket(self._hb, self._on_readable)
        # Monitors before connecting: a handshake can fail before a later monitor would see it.
        events = self._main.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)
        self._loop.add_socket(events, self._on_connection_event)
        if self.enable_heartbeat:  # a crashed server closes its connections: notice at once
            self._loop.add_socket(self._hb.get_monitor_socket(zmq.EVENT_DISCONNECTED), self._on_disconnect)
        self._loop.on_exit.append(self._disable_monitors)
        self._main.connect(endpoint)
        self._hb.connect(endpoint)
        self._loop.start()
        hello = Message(MessageType.HELLO, {
            "client": {"host": socket.gethostname(), "pid": os.getpid(), "user": os.environ.get("USER", ""), "purpose": self.purpose},
            "heartbeat": self._hb.getsockopt(zmq.ROUTING_ID).hex(),  # the server takes pings, and sends events, there only
        })
        left = self.timeout - (time.monotonic() - start)
        try:
            request = self._request(hello, self._main)
            if self._handshake_error is not None and self._pending.pop(request.id, None) is not None:
                raise self._handshake_error  # it failed before the hello was even registered
            welcome = request.wait(timeout=max(left, 0.1))
        except TimeoutError:
            self.close(notify=False)
            raise ConnectionFailed(
                f"the server at {self.address} accepted a TCP connection but did not answer the Genie handshake "
                f"within {self.timeout:g} s: is a genie server (protocol genie/2) listening there?"
            ) from None
        except BaseException:
            self.close(notify=False)
            raise

        self.session = welcome.content["session"]
        self.node = welcome.content.get("node", {})
        self.slot = welcome.content.get("slot")
        self._last_heard = time.monotonic()
        if self.enable_heartbeat:
            self._loop.call_every(self.heartbeat_interval, self._heartbeat)
        self._event(EventType.CONNECTED, Severity.INFO, f"connected to {self.address} (session {self.session[:8]})", session=self.session[:8])
        return self

    def _disable_monitors(self) -> None:
        """On the loop thread as it ends: stop socket monitors before their sockets close."""
        for sock in (self._main, self._hb):
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass

    def select_backend(self, requested: str = "auto", budget: float = 1.0) -> BackendReport:
        """Measure the data-plane backends to this server and use the best (or the one asked for)."""
        report, transport = discover(self, requested, budget)
        with self._transfer_lock:
            self.transport.close()
            self.transport, self.backend_report = transport, report
        self._request(Message("set_backend", {"backend": report.chosen})).wait(5)
        self._event(EventType.BACKEND_SELECTED, Severity.INFO, report.reason, backend=report.chosen, report=report.to_dict())
        return report

    def _probe_server(self) -> None:
        """Fail fast, with the reason, when nothing listens, something other than ZMTP answers, or
        the server's encryption differs from ours (zmq itself would retry silently). Exchanges
        the start of a greeting, and reads the server's, which names its security mechanism."""
        where = f"a genie server at {self.address}"
        deadline = time.monotonic() + self.timeout
        connected = False
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as sock:
                connected = True
                sock.sendall(ZMTP_SIGNATURE)
                greeting = b""
                while len(greeting) < GREETING_BYTES:
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    chunk = sock.recv(GREETING_BYTES - len(greeting))
                    if not chunk:
                        break
                    greeting += chunk
        except ConnectionRefusedError:
            raise ConnectionFailed(f"could not connect to {where}: connection refused (is `genie serve` running there?)") from None
        except socket.gaierror as exc:
            raise ConnectionFailed(f"could not connect to {where}: unknown host ({exc.strerror})") from None
        except (socket.timeout, TimeoutError):
            raise ConnectionFailed(
                f"could not connect to {where}: no answer within {self.timeout:g} s" if not connected else
                f"the server at {self.address} accepted a TCP connection but did not answer the Genie handshake "
                f"within {self.timeout:g} s: is a genie server (protocol genie/2) listening there?") from None
        except OSError as exc:
            raise ConnectionFailed(f"could not connect to {where}: {exc.strerror or exc}") from None
        if len(greeting) < GREETING_BYTES:
            raise ConnectionFailed(f"the server at {self.address} closed the connection during the Genie handshake "
                                   "(it stopped or crashed, or it is not a genie server)")
        if greeting[0] != 0xFF or greeting[9] != 0x7F:
            raise ConnectionFailed(f"the server at {self.address} does not speak ZMTP: is a genie server listening there?")
        mechanism = greeting[12:32].rstrip(b"\0")
        if mechanism == b"CURVE" and not self.curve:
            raise AuthenticationError(
                f"the server at {self.address} requires encryption (genie serve --encrypt): connect with its "
                "connection file (--connection-file), which holds the keys")
        if mechanism == b"NULL" and self.curve:
            raise ConnectionFailed(f"the server at {self.address} does not encrypt (it was started without --encrypt), "
                                   "but the connection file holds encryption keys: use its current connection file")

    def _on_connection_event(self, monitor: zmq.Socket) -> None:
        """The control connection's events. During the handshake, a failure (CURVE keys,
        mechanism) or a closed connection is final: say why at once instead of waiting for the
        timeout. After it, a closed connection loses what was in flight on it (zmq reconnects by
        itself): those requests fail now, and "did it run?" asks about them once it is back."""
        from zmq.utils.monitor import recv_monitor_message

        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            if self.session:
                if event["event"] == zmq.EVENT_DISCONNECTED and not self._closed:
                    self._mark_lost(f"connection to genie server at {self.address} lost: the server closed the connection")
                continue
            if self._handshake_error is not None:
                continue  # the first event says why; a disconnect follows every failed handshake
            kind, value = event["event"], event["value"]
            mismatch = kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                error: GenieError = AuthenticationError(
                    f"the server at {self.address} refused this client's encryption key: use the connection file "
                    "the server wrote this time it started (`genie serve --encrypt` makes new keys at each start)")
            elif mismatch and not self.curve:
                error = AuthenticationError(
                    f"the server at {self.address} requires encryption (genie serve --encrypt): connect with its "
                    "connection file (--connection-file), which holds the keys")
            elif mismatch:
                error = ConnectionFailed(f"the server at {self.address} does not encrypt (it was started without --encrypt), "
                                         "but the connection file holds encryption keys: use its current connection file")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                error = ConnectionFailed(f"the handshake with {self.address} broke the ZMTP protocol (error {value:#x}): "
                                         "is a genie server listening there?")
            elif self.curve:  # the server drops a client whose key exchange it cannot read
                error = ConnectionFailed(f"the encryption handshake with {self.address} failed: the server there does not hold "
                                         "the key in the connection file (a stale file, or someone in between), or it "
                                         "stopped during the handshake")
            else:
                error = ConnectionFailed(f"the server at {self.address} closed the connection during the Genie handshake "
                                         "(it stopped or crashed, or it is not a genie server)")
            self._handshake_error = error  # first, then the hello: connect() checks in the other order
            for request in [r for r in list(self._pending.values()) if r.type == "hello"]:
                self._pending.pop(request.id, None)
                request._put(_Closed(error))

    @staticmethod
    def _dealer(ctx: zmq.Context, curve: dict[str, str] | None = None) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # harmless for IPv4 addresses
        if curve:
            from .encryption import secure_client

            secure_client(sock, curve)
        return sock

    # -- sending and receiving ------------------------------------------------------------
    def _request(self, msg: Message, sock: zmq.Socket | None = None) -> Request:
        if self._closed or self._loop is None:
            raise ConnectionLost(f"the connection to {self.address} is closed")
        request = Request(self, msg)
        # Registered first, then checked: a connection lost meanwhile either sees it, or is seen here.
        self._pending[msg.id] = request
        if self.lost_reason is not None and msg.type not in (MessageType.HELLO, MessageType.PING, MessageType.OUTCOME):
            self._pending.pop(msg.id, None)
            raise ConnectionLost(self.lost_reason)
        target = sock or self._main
        msg.session = self.session
        limit = (self.node.get("limits") or {}).get("message_bytes")
        with self._send_locks[target]:  # sequence numbers must reach each socket in order
            msg.seq = next(self._seq)
            frames = self.codec.pack(msg)
            size = sum(memoryview(f).nbytes for f in frames)
            if limit is not None and size > limit:  # the server would drop the connection instead
                self._pending.pop(msg.id, None)
                raise LimitExceeded(f"this {msg.type} message of {size_text(size)} is over the {size_text(limit)} the server "
                                    f"at {self.address} takes in one message (GENIE_MAX_MESSAGE_BYTES there)")
            self._loop.call_soon(lambda: self._loop.send(target, frames))
        return request

    def _on_readable(self, sock: zmq.Socket) -> None:
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self.codec.unpack(frames)
            except ProtocolError as exc:
                self._on_unauthenticated(frames, exc)
                continue
            if parse(msg.type, Peer.SERVER) is None:
                log.warning("dropped a %r message from %s: servers do not send that", msg.type, self.address)
                continue
            self._last_heard = time.monotonic()
            if msg.type == "pong":
                self.rtt = time.monotonic() - getattr(self._pending.get(msg.parent), "sent", time.monotonic())
            session_unknown = msg.type == "error_reply" and msg.content.get("ename") == "SessionNotFound"
            if self.lost_reason is not None and self.session and not self._session_gone and not session_unknown:
                self._recovered()
            if not msg.parent:
                self._on_push(msg)
                continue
            request = self._pending.get(msg.parent)
            if request is not None and msg.type in TERMINAL:
                self._pending.pop(msg.parent, None)
            if request is None and msg.parent in self.lost_requests:
                self._late_reply(self.lost_requests[msg.parent], msg)
            if session_unknown:
                self._session_ended(msg.content.get("evalue", "session not found"))
            if request is not None:
                request._put(msg)

    def _on_disconnect(self, monitor: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED and self.session and not self._closed:
                self._mark_lost(f"connection to genie server at {self.address} lost: the server closed the connection (it stopped or crashed)")

    def _on_unauthenticated(self, frames: list[Any], exc: ProtocolError) -> None:
        try:
            msg = Codec(None).unpack(frames, verify=False)
        except ProtocolError:
            log.warning("dropped a malformed message from %s: %s", self.address, exc)
            return
        request = self._pending.pop(msg.parent, None)
        if msg.type == "auth_failed" and request is not None and request.type == "hello":
            request._put(_Closed(AuthenticationError(
                f"authentication failed: the token does not match the server at {self.address} "
                "(see the `genie serve` output or its connection file)")))
        else:
            log.warning("dropped an unauthenticated message from %s: %s", self.address, exc)

    def _heartbeat(self) -> None:
        silent_for = time.monotonic() - self._last_heard
        if self.lost_reason is None and silent_for > self.heartbeat_timeout:
            self._mark_lost(f"connection to genie server at {self.address} lost: no heartbeat for {silent_for:.1f} s")
        for rid, req in list(self._pending.items()):
            if req.type == "ping" and time.monotonic() - req.sent > self.heartbeat_timeout:
                self._pending.pop(rid, None)
        try:
            self._request(Message("ping"), self._hb)
        except ConnectionLost:
            pass

    def _mark_lost(self, reason: str) -> None:
        if self.lost_reason is not None:
            return
        self.lost_reason = reason
        log.warning(reason)
        for rid, request in list(self._pending.items()):
            if request.type != "ping":
                self._pending.pop(rid, None)
                why = reason
                if request.type in RUNS:
                    self.lost_requests[rid] = LostRequest(rid, request.type, request.summary, time.time())
                    while len(self.lost_requests) > KEEP_LOST:
                        self.lost_requests.pop(next(iter(self.lost_requests)))
                    why += (f". The {'cell' if request.type == 'execute' else request.type} had been sent and may still run there: "
                            "whether it ran is reported once the server answers again")
                request._put(_Closed(ConnectionLost(why)))
        self._event(EventType.NODE_LOST, Severity.ERROR, reason, last_seen=time.time() - (time.monotonic() - self._last_heard))

    def _recovered(self) -> None:
        """The server answers again (after a partition or a pause): resume, and ask about lost requests."""
        self.lost_reason = None
        self._event(EventType.NODE_RECOVERED, Severity.INFO, f"{self.address} answers again")
        self._ask_outcomes_in_background()

    def _late_reply(self, lost: LostRequest, msg: Message) -> None:
        """A reply to a request we gave up on: it ran after all. Keep its output; settle it at the end."""
        if msg.type == "stream" and len(lost.output) < KEEP_OUTPUT:
            lost.output += str(msg.content.get("text", ""))[: KEEP_OUTPUT - len(lost.output)]
        elif msg.type == "error":
            lost.error = error_text(msg.content)
        if msg.type == "error_reply" and msg.content.get("ename") == "SessionNotFound":
            self._settle(lost, "not run", "", "it reached the server after the server had ended the session")
        elif msg.type in TERMINAL:
            status = "error" if msg.type == "error_reply" else str(msg.content.get("status", "ok"))
            self._settle(lost, "finished", status, lost.error or error_text(msg.content))

    def _ask_outcomes_in_background(self) -> None:
        if any(not r.settled for r in self.lost_requests.values()):
            threading.Thread(target=self._ask_outcomes, name="genie-outcomes", daemon=True).start()

    def _ask_outcomes(self) -> None:
        """After a lost connection comes back: ask the server what became of each lost request.
        The question travels behind those requests on the same connection, so the answer is final."""
        ids = [r.id for r in self.lost_requests.values() if not r.settled]
        try:
            reply = self._request(Message("outcome", {"ids": ids})).wait(10)
        except Exception as exc:
            if self._session_gone:  # and the server does not remember it (it restarted): nobody can say
                for lost in self.lost_requests.values():
                    if not lost.settled:
                        self._settle(lost, "unknown", "", "the server ended the session and no longer remembers it")
            else:
                log.warning("could not learn the outcome of %d lost requests: %s", len(ids), exc)
            return
        for rid, outcome in reply.content.get("outcomes", {}).items():
            lost = self.lost_requests.get(rid)
            if lost is None or lost.settled:
                continue
            if outcome.get("state") == "finished":
                self._settle(lost, "finished", str(outcome.get("status", "")), str(outcome.get("error", "")))
            elif outcome.get("state") == "not received":
                self._settle(lost, "not run", "", "")
            elif outcome.get("state") == "stopped":
                self._settle(lost, "stopped", "", str(outcome.get("error", "")))
            else:
                lost.state = "running"  # its reply follows on this connection

    def _session_ended(self, why: str) -> None:
        """The server no longer knows our session (it expired while we were cut off, or the
        server restarted): this connection is done, and lost requests that did not settle never will."""
        if self.lost_reason is None:
            self._mark_lost(why)
        self.lost_reason = f"{why}; run %genie_init (or genie_core.init) again to start a new session"
        if not self._session_gone:
            self._session_gone = True
            self._ask_outcomes_in_background()  # the server keeps an ended session's record for a while

    def _settle(self, lost: LostRequest, state: str, status: str, error: str) -> None:
        lost.state, lost.status, lost.error, lost.settled = state, status, error, True
        severity = Severity.WARNING if state == "finished" else Severity.INFO if state == "not run" else Severity.ERROR
        self._event(EventType.REQUEST_OUTCOME, severity, lost.describe(), request=lost.id, state=state, status=status)

    def take_settled(self) -> list[LostRequest]:
        """Lost requests whose fate is now known and not yet reported (each is returned once)."""
        done = [r for r in self.lost_requests.values() if r.settled and not r.reported]
        for r in done:
            r.reported = True
        return done

    def _on_push(self, msg: Message) -> None:
        """Messages the server sends on its own: events and metric snapshots."""
        if msg.type == "event":
            self.events.emit(ClusterEvent.from_dict(msg.content))
        elif msg.type == "metrics":
            self.metrics = NodeInfo.from_dict(msg.content["node"])
            if msg.content.get("health"):
                self.server_health = HealthReport.from_dict(msg.content["health"])
            self.events.emit(ClusterEvent(EventType.METRICS, self.metrics.node_id, Severity.INFO, msg.content))

    def _event(self, kind: EventType, severity: Severity, message: str, **data: Any) -> None:
        node = self.node.get("node_id", self.address)
        self.events.emit(ClusterEvent(kind, node, severity, {"message": message, "address": self.address, **data}))

    @property
    def health(self) -> HealthReport | None:
        """The server's own report plus what only the client sees: the network and the peer."""
        base = self.server_health
        if base is None and self.lost_reason is None:
            return None
        checks = list(base.checks) if base else []
        if self.rtt is not None:
            slow = self.rtt >= 0.5
            checks.append(HealthCheck("network", Grade.DEGRADED if slow else Grade.HEALTHY, f"network: heartbeat round trip {self.rtt * 1000:.1f} ms"))
        lost = self.lost_reason is not None
        checks.append(HealthCheck("peers", Grade.UNHEALTHY if lost else Grade.HEALTHY, self.lost_reason if lost else f"peers: {self.address} reachable"))
        node = base.node if base else self.node.get("node_id", self.address)
        return HealthReport(node, worst([c.grade for c in checks]), checks)

    # -- the API --------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return bool(self.session) and self.lost_reason is None and not self._closed

    def execute(self, code: str, *, gpu: int | None = None, silent: bool = False) -> Request:
        request = self._request(Message("execute", {"code": code, "gpu": gpu, "silent": silent}))
        first = next((line.strip() for line in code.splitlines() if line.strip()), "")
        request.summary = first if len(first) <= 60 else first[:57] + "..."
        return request

    def interrupt(self, request: Request | str | None = None) -> None:
        """Interrupt a cell (default: whichever runs): KeyboardInterrupt in its code, or, if it has
        not started yet, it never runs. Its own reply says which; a finished cell is left alone."""
        target = request.id if isinstance(request, Request) else request
        self._request(Message("interrupt", {"request": target}))

    def push(self, values: dict[str, Any], *, gpu: int | None = None, device: str | None = None, timeout: float | None = None,
             progress: Any = None) -> list[str]:
        """Send values to the session's worker. `progress(done, total)` follows the bytes (data plane only)."""
        metas, buffers = serialize_namespace(values)
        size = sum(memoryview(b).nbytes for b in buffers)
        limit = (self.node.get("limits") or {}).get("session_bytes")
        if limit is not None and size > limit:  # said before a byte is sent
            raise LimitExceeded(f"this push of {size_text(size)} is more than the server lets a session hold "
                                f"({size_text(limit)}, --max-session-bytes)")
        content: dict[str, Any] = {"values": metas, "gpu": gpu, "device": device}
        with self._transfer_lock:  # one transfer at a time on the data plane; the reply frees its buffer
            if self.transport.name != "zmq" and size >= DATA_THRESHOLD:
                with self._data_errors("push"):
                    content["data"] = self.transport.put(buffers, progress)
                buffers = []
            try:
                reply = self._request(Message("push", content, buffers)).wait(timeout)
            except BaseException:
                ref = content.get("data")
                if ref and ref.get("via") == "shm":  # ours, and nobody adopted it: remove it
                    Segment.discard(ref["segment"])
                raise
            finally:
                if "data" in content and hasattr(self.transport, "after"):
                    self.transport.after()
        if reply.content.get("status") != "ok":
            raise error_from(reply.content)
        return list(reply.content.get("names", []))

    def pull(self, names: list[str], *, gpu: int | None = None, timeout: float | None = None, progress: Any = None) -> dict[str, Any]:
        """Bring values back from the session's worker. `progress(done, total)` as with `push`."""
        via = None if self.transport.name == "zmq" else self.transport.name
        with self._transfer_lock:
            reply = self._request(Message("pull", {"names": list(names), "gpu": gpu, "via": via})).wait(timeout)
            if reply.content.get("status") != "ok":
                raise error_from(reply.content)
            ref = reply.content.get("data")
            if ref:
                with self._data_errors("pull"):
                    buffers = self.transport.get(dict(ref, via=via), progress)
            else:
                buffers = reply.buffers
        return deserialize_namespace(reply.content["values"], buffers)

    @contextlib.contextmanager
    def _data_errors(self, what: str) -> Iterator[None]:
        """A data connection that breaks is a lost connection, said plainly (whatever the backend raised)."""
        try:
            yield
        except GenieError:
            raise
        except Exception as exc:
            raise ConnectionLost(
                f"the {self.transport.name} data connection to genie server at {self.address} broke during a {what} "
                f"({type(exc).__name__}: {exc}); run %genie_init (or genie_core.init) to reconnect"
            ) from None

    def ping(self, timeout: float = 5.0) -> float:
        start = time.perf_counter()
        self._request(Message("ping")).wait(timeout)
        return time.perf_counter() - start

    def info(self, timeout: float = 5.0, history_points: int = 60, events: int = 50) -> dict[str, Any]:
        """The server's node, latest readings, health, recent history and events, sessions."""
        return self._request(Message("info", {"history_points": history_points, "events": events})).wait(timeout).content

    def close(self, notify: bool = True) -> None:
        if self._closed:
            return
        if notify and self.connected:
            try:
                self._request(Message("close")).wait(timeout=1.0)
            except Exception:
                pass  # the server reaps the session after its lease anyway
        self._closed = True
        if self.session:
            self._event(EventType.SESSION_CLOSED, Severity.INFO, f"session {self.session[:8]} closed", session=self.session[:8])
        for request in list(self._pending.values()):
            request._put(_Closed(ConnectionLost(f"the connection to {self.address} was closed")))
        self._pending.clear()
        self.transport.close()
        if self._loop is not None:
            self._loop.stop(timeout=2.0)  # the loop closes the sockets, then ends the context: bounded
