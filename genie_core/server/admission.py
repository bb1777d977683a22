"""Who gets in: every message from the network passes here before anything acts on it.

In order: a valid signature (big messages are hashed off the loop thread, and later messages of
the same connection wait behind them), a session this server holds, a connection that belongs
to that session (its control connection, or the heartbeat connection its hello named), a
sequence number above the last one from that connection (no replays), a type that kind of
connection may send (the protocol's table), and for requests that run, an id never seen before.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import BadSignature, ProtocolError
from ..protocol import RUNS, VERSIONS_TAG, Codec, Message, MessageType, Peer, contents, parse, split_identities
from ..protocol.errors import SESSION_NOT_FOUND, error_content
from ..threads import name_os_thread
from ..versions import local_versions
from .sessions import Session

log = logging.getLogger("genie.server")

VERIFIERS = 2  # threads that check big messages' signatures (a bounded pool)
BIG_MESSAGE = 8 << 20  # bytes of buffers above which a signature is checked off the loop thread
HEADER_BYTES = 4096  # of an unverified header read to answer a refused request (a real one is ~200)
HELLO_MAX_AGE = 300.0  # seconds: a hello stamped further from our clock is refused (replayed, or a clock far off)
HELLOS_REMEMBERED = 10_000  # ids of recent hellos: a hello is taken once


@dataclass
class Admitted:
    """A message that passed every check, with what it was checked against."""

    identity: bytes
    msg: Message
    type: MessageType
    peer: Peer
    session: Session | None  # None for a hello, which opens one


Reply = Callable[[bytes, Message, str, Mapping[str, Any]], None]


class Admission:
    def __init__(
        self,
        *,
        codec: Codec,
        sessions: dict[str, Session],
        ended: OrderedDict[str, Session],
        call_soon: Callable[[Callable[[], None]], None],
        admit: Callable[[Admitted], None],
        reply: Reply,
        send_raw: Callable[[bytes, list[Any]], None],
    ) -> None:
        self.codec = codec
        self.sessions, self.ended = sessions, ended
        self._call_soon = call_soon  # back onto the loop thread
        self._admit = admit
        self._reply = reply
        self._send_raw = send_raw  # for the one unsigned answer: a hello with the wrong token
        self._backlog: dict[bytes, deque[list[Any]]] = {}
        self._hellos: OrderedDict[str, float] = OrderedDict()  # recent hello ids, oldest first
        self._verifier = ThreadPoolExecutor(
            max_workers=VERIFIERS, thread_name_prefix="genie-verify", initializer=name_os_thread
        )

    def close(self) -> None:
        self._verifier.shutdown(wait=False, cancel_futures=True)

    # -- signatures -----------------------------------------------------------------------
    def on_frames(self, frames: list[Any]) -> None:
        """A message as the ROUTER socket gave it (loop thread)."""
        try:
            idents, body = split_identities(frames)
            identity = idents[0].bytes if hasattr(idents[0], "bytes") else bytes(idents[0])
        except (ProtocolError, IndexError) as exc:
            log.warning("dropped a malformed message: %s", exc)
            self._answer_other_protocol(frames)
            return
        backlog = self._backlog.get(identity)
        if backlog is not None:  # an earlier big message from this connection is still being verified
            backlog.append(body)
        elif sum(len(f) for f in body[4:]) >= BIG_MESSAGE:
            self._verify_in_background(identity, body)
        else:
            self._check(identity, body, None)

    def _verify_in_background(self, identity: bytes, body: list[Any]) -> None:
        """Hash big buffers off the loop thread (hashlib releases the GIL), so heartbeats and
        other sessions are answered meanwhile; later messages of this connection wait their turn."""
        self._backlog[identity] = deque()

        def verify() -> Message | ProtocolError:
            try:
                return self.codec.unpack(body)
            except ProtocolError as exc:
                return exc

        future = self._verifier.submit(verify)
        future.add_done_callback(lambda f: self._call_soon(lambda: self._verified(identity, body, f.result())))

    def _verified(self, identity: bytes, body: list[Any], result: Message | ProtocolError) -> None:
        backlog = self._backlog.pop(identity, deque())
        self._check(identity, body, result)
        while backlog:
            if identity in self._backlog:  # another big one started: the rest waits behind it
                self._backlog[identity].extend(backlog)
                return
            self.on_frames([identity, *backlog.popleft()])

    # -- the checks -----------------------------------------------------------------------
    def _check(self, identity: bytes, body: list[Any], verified: Message | ProtocolError | None) -> None:
        try:
            if isinstance(verified, ProtocolError):
                raise verified
            msg = verified or self.codec.unpack(body)
        except ProtocolError as exc:
            log.warning("dropped a message that failed authentication or parsing: %s", exc)
            self._answer_bad_signature(identity, body, exc)
            return
        if msg.type == MessageType.HELLO:
            if self._fresh_hello(msg):
                self._admit(Admitted(identity, msg, MessageType.HELLO, Peer.CLIENT, None))
            return
        session = self.sessions.get(msg.session)
        if session is None:
            ended = self.ended.get(msg.session)
            if ended is not None and msg.type == MessageType.OUTCOME and identity == ended.identity:
                # "Did it run?" from a client whose session ended while it was cut off: answer from the record.
                self._admit(Admitted(identity, msg, MessageType.OUTCOME, Peer.CLIENT, ended))
                return
            self._not_yours(
                identity, msg, "this session is unknown to the server (it ended, expired, or the server restarted)"
            )
            return
        peer = session.peer(identity)
        if peer is None and identity in session.former:
            # Its client was replaced by one that attached to this named session: tell it so, once per request.
            who = f"{session.client.get('host', '?')}, pid {session.client.get('pid', '?')}"
            self._not_yours(
                identity, msg, f"session {session.name!r} was attached by another client ({who}); this one is detached"
            )
            return
        if peer is None:
            self._refuse(f"a {msg.type!r} message for session {session.id[:8]} from a connection that is not its own")
            return
        if not session.accept_seq(identity, msg.seq):
            self._refuse(f"a replayed or out-of-order {msg.type!r} message for session {session.id[:8]}")
            return
        kind = parse(msg.type, peer)
        if kind is None:
            self._refuse(
                f"a {msg.type!r} message from session {session.id[:8]}'s {peer.value} connection, which may not send it"
            )
            if peer is Peer.CLIENT:  # a client that waits for an answer gets one
                self._reply(
                    identity,
                    msg,
                    MessageType.ERROR_REPLY,
                    error_content("ProtocolError", f"unknown request type {msg.type!r}"),
                )
            return
        session.last_seen = time.monotonic()
        if kind in RUNS and not session.received(msg.id, kind):
            self._reply(
                identity,
                msg,
                MessageType.ERROR_REPLY,
                error_content("DuplicateRequest", f"request {msg.id} was received before and runs at most once"),
            )
            return
        self._admit(Admitted(identity, msg, kind, peer, session))

    def _not_yours(self, identity: bytes, msg: Message, why: str) -> None:
        """The session named is not (or no longer) this connection's: the client ends it on its side."""
        self._reply(identity, msg, MessageType.ERROR_REPLY, error_content(SESSION_NOT_FOUND, why))

    def _fresh_hello(self, msg: Message) -> bool:
        """A signed hello is taken once, and only near the time it says it was sent: a recorded
        hello replayed later (it would take a named session over) is refused."""
        now = time.time()
        if abs(now - msg.time) > HELLO_MAX_AGE:
            self._refuse(
                f"a hello stamped {now - msg.time:+.0f} s from this server's clock (over {HELLO_MAX_AGE:.0f} s)"
            )
            return False
        while self._hellos and (
            len(self._hellos) >= HELLOS_REMEMBERED or next(iter(self._hellos.values())) < now - HELLO_MAX_AGE
        ):
            self._hellos.popitem(last=False)
        if msg.id in self._hellos:
            self._refuse(f"a replayed hello ({msg.id})")
            return False
        self._hellos[msg.id] = now
        return True

    @staticmethod
    def _refuse(what: str) -> None:
        log.warning("refused %s", what)

    def _answer_other_protocol(self, frames: list[Any]) -> None:
        """A client speaking another protocol version (a tag `genie/N` in its second frame) is told
        this server's protocol and Genie version, unsigned, so that it can say what to install
        instead of timing out. Only those two: nothing else about the server or its sessions."""
        if len(frames) < 2 or len(frames[1]) > 16:
            return
        identity, tag = (bytes(f.bytes if hasattr(f, "bytes") else f) for f in frames[:2])
        if tag.startswith(b"genie/"):
            ours = local_versions()
            answer = {"protocol": ours["protocol"], "genie": ours["genie"]}
            self._send_raw(identity, [VERSIONS_TAG, json.dumps(answer).encode()])

    def _answer_bad_signature(self, identity: bytes, body: list[Any], exc: ProtocolError) -> None:
        """Answer a message whose signature fails, so that its sender need not wait for a timeout;
        only its header is read (at most HEADER_BYTES, unverified: its type, session and id).
        - A hello: the wrong token. Unsigned (we share no key with it) and carrying nothing.
        - A request on its session's own control connection (its bytes changed while it was sent,
          or a client's bug): an error, signed, to that connection alone. It does not run, and its
          sequence number is not taken.
        Any other connection hears nothing."""
        if not isinstance(exc, BadSignature) or len(body[2]) > HEADER_BYTES:
            return
        try:
            header = json.loads(bytes(body[2].buffer if hasattr(body[2], "buffer") else body[2]))
            kind, session_id, msg_id = str(header["type"]), str(header["session"]), str(header["id"])
        except Exception:  # (anything unparseable, nested past the recursion limit, or missing a key)
            return
        if kind == MessageType.HELLO:
            reason = contents.AuthFailed(reason="signature does not match: wrong token")
            self._send_raw(identity, Codec(None).pack(Message(MessageType.AUTH_FAILED, reason, parent=msg_id)))
            return
        session = self.sessions.get(session_id)
        if session is None or session.peer(identity) is not Peer.CLIENT:
            return
        why = (
            "the server refused this request: its signature does not match its bytes "
            "(did a buffer change while it was being sent?); it was not run"
        )
        claimed = Message(kind, session=session_id, id=msg_id)
        self._reply(identity, claimed, MessageType.ERROR_REPLY, error_content("ProtocolError", why))
