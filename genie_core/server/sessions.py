"""Clients' sessions on the server: who each one is, its connections, its replay protection,
and the record of its requests that answers "did it run?" (kept a while after it ends).

A session may have a name (`%genie_init ADDR --session NAME`): a named session outlives its
client (a kernel restart, a closed laptop) and a later hello with the same name attaches to it,
namespace, GPU memory and jobs intact."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import cast

from ..protocol import Message, Peer, contents, error_text
from .jobs import Jobs
from .session_dir import SessionDirectory

REMEMBERED = 1000  # requests whose outcome a session remembers, for "did it run?" after a lost connection
ENDED_REMEMBERED = 64  # ended sessions whose request records are kept


class Session:
    def __init__(
        self,
        identity: bytes,
        client: dict[str, str],
        slot: int,
        heartbeat_identity: bytes | None = None,
        name: str = "",
    ) -> None:
        self.id = secrets.token_urlsafe(18)  # unguessable: it is half of what binds a client to its worker
        self.identity = identity
        self.client = client
        self.slot = slot
        self.last_seen = time.monotonic()
        self.created = time.time()
        self._seqs: dict[bytes, int] = {}
        self.backend = "zmq"  # the data-plane backend the client chose
        self.heartbeat_identity = heartbeat_identity  # named in the hello; events go there, never behind a transfer
        self.requests: OrderedDict[str, contents.RequestOutcome] = OrderedDict()  # id -> what became of it
        self.name = name
        self.end_reason = ""  # why it ended, once it has
        self.jobs = Jobs()
        self.directory: SessionDirectory | None = None  # the session directory, once %genie_sync has filled it
        self.former: set[bytes] = set()  # connections of clients it had before this one attached
        self.detached = False  # named, and its client has been silent for the lease: kept, waiting
        self.idle_warned = False  # the SESSION_IDLE warning went out
        self.quiet_since = time.monotonic()  # since when nothing has run (monotonic)

    def received(self, request_id: str, kind: str) -> bool:
        """Note a request that will run; False if this id was seen before (it runs at most once)."""
        if request_id in self.requests:
            return False
        self.requests[request_id] = {"state": "running", "type": kind, "received": time.time()}
        while len(self.requests) > REMEMBERED:
            self.requests.popitem(last=False)
        return True

    def finished(self, request_id: str, content: contents.Failure) -> None:
        """Its terminal reply went out: `content` has its status (an error reply has none: error)."""
        self.jobs.finish(request_id, content)
        entry = self.requests.get(request_id)
        if entry is not None:
            entry["state"] = "finished"
            entry["status"] = str(cast(contents.Reply, content).get("status", "error"))
            entry["finished"] = time.time()
            if content.get("ename"):
                entry["error"] = error_text(content)

    def ended(self, why: str) -> None:
        """The session is closing: requests still running are stopped with it."""
        self.end_reason = why
        self.jobs.stop_all(f"stopped part-way when the server ended the session ({why})")
        for entry in self.requests.values():
            if entry["state"] == "running":
                entry["state"] = "stopped"
                entry["error"] = f"stopped part-way when the server ended the session ({why})"

    def outcome(self, request_id: str) -> contents.RequestOutcome:
        """What became of a request: running, finished (with its status), or not received."""
        entry = self.requests.get(request_id)
        return entry.copy() if entry is not None else {"state": "not received"}

    def peer(self, identity: bytes) -> Peer | None:
        """Which of this session's connections `identity` is; None if it is not one of them."""
        if identity == self.identity:
            return Peer.CLIENT
        if identity == self.heartbeat_identity:
            return Peer.HEARTBEAT
        return None

    def accept_seq(self, identity: bytes, seq: int) -> bool:
        """Sequence numbers rise strictly per connection; anything else is a replay."""
        if seq <= self._seqs.get(identity, -1):
            return False
        self._seqs[identity] = seq
        return True

    @property
    def event_identity(self) -> bytes:
        return self.heartbeat_identity or self.identity

    def attach(self, identity: bytes, heartbeat_identity: bytes | None, client: dict[str, str], seq: int) -> None:
        """A new client takes the session over; its former connections are refused from now on."""
        self.former |= {i for i in (self.identity, self.heartbeat_identity) if i is not None}
        self.former -= {identity, heartbeat_identity}
        self.identity, self.heartbeat_identity, self.client = identity, heartbeat_identity, client
        self._seqs = {identity: seq}
        self.last_seen = time.monotonic()
        self.detached = False

    def idle_s(self) -> float:
        """Seconds since its client last said anything."""
        return time.monotonic() - self.last_seen

    def info(self) -> contents.SessionInfo:
        return {
            "id": self.id[:8],
            "name": self.name,
            "jobs_running": len(self.jobs.running()),
            "detached": self.detached,
            "client": self.client,
            "slot": self.slot,
            "backend": self.backend,
            "created": self.created,
            "idle_s": round(self.idle_s(), 3),
        }


class SessionTable:
    """The sessions a server holds, and the records of the last ENDED_REMEMBERED that ended."""

    def __init__(self) -> None:
        self.live: dict[str, Session] = {}
        self.ended: OrderedDict[str, Session] = OrderedDict()

    def open(self, identity: bytes, hello: Message, next_slot: Callable[[], int]) -> tuple[Session, bool]:
        """A session for a client's hello, and whether it is an existing one (a hello naming a live
        named session attaches to it). Its heartbeat connection is the one the hello names."""
        said = cast(contents.Hello, hello.content)
        client = {k: str(v)[:200] for k, v in dict(said.get("client") or {}).items()}
        try:
            heartbeat: bytes | None = bytes.fromhex(str(said.get("heartbeat") or ""))[:255] or None
        except ValueError:
            heartbeat = None
        heartbeat = heartbeat if heartbeat != identity else None
        name = str(said.get("name") or "").strip()[:64]
        existing = self.named(name) if name else None
        if existing is not None:
            existing.attach(identity, heartbeat, client, hello.seq)
            return existing, True
        session = Session(identity, client, next_slot(), heartbeat, name)
        session.accept_seq(identity, hello.seq)
        self.live[session.id] = session
        return session, False

    def refuse_attach(self, hello: Message) -> str:
        """Why a hello may not take a named session over ("" if it may): a session whose client is
        still there is only handed to the same user (a second notebook of theirs), so that two
        people who pick the same name do not share a namespace. The token is what authenticates;
        this only keeps honest users apart."""
        said = cast(contents.Hello, hello.content)
        name = str(said.get("name") or "").strip()[:64]
        session = self.named(name) if name else None
        if session is None or session.detached:
            return ""
        user = str(dict(said.get("client") or {}).get("user", ""))[:200]
        if user == session.client.get("user", ""):
            return ""
        return (
            f"session {name!r} is in use by {session.client.get('user') or '?'}@{session.client.get('host', '?')} "
            f"(pid {session.client.get('pid', '?')}): pick another --session name"
        )

    def named(self, name: str) -> Session | None:
        return next((s for s in self.live.values() if s.name == name), None)

    def end(self, session: Session, why: str) -> None:
        """It ends: what it was running is recorded as stopped, and the record kept a while."""
        self.live.pop(session.id, None)
        session.ended(why)
        self.ended[session.id] = session
        while len(self.ended) > ENDED_REMEMBERED:
            self.ended.popitem(last=False)

    def expired(self, lease: float) -> list[Session]:
        """Sessions whose clients have said nothing for `lease` seconds."""
        now = time.monotonic()
        return [s for s in self.live.values() if now - s.last_seen > lease]


def outcomes(session: Session, msg: Message) -> contents.OutcomeReply:
    """ "Did it run?": for each request id asked about, running, finished (with status), stopped,
    or not received."""
    ids = [str(i)[:64] for i in list(cast(contents.Outcome, msg.content).get("ids") or [])[:1000]]
    return {"outcomes": {i: session.outcome(i) for i in ids}}
