"""A client's session on the server: who it is, its workers, and its replay protection."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Any

from ..protocol import Peer
from .worker_process import WorkerProcess


REMEMBERED = 1000  # requests whose outcome a session remembers, for "did it run?" after a lost connection


class Session:
    def __init__(self, identity: bytes, client: dict[str, Any], slot: int, heartbeat_identity: bytes | None = None) -> None:
        self.id = secrets.token_urlsafe(18)  # unguessable: it is half of what binds a client to its worker
        self.identity = identity
        self.client = client
        self.slot = slot
        self.workers: dict[int, WorkerProcess] = {}
        self.last_seen = time.monotonic()
        self.created = time.time()
        self._seqs: dict[bytes, int] = {}
        self.backend = "zmq"  # the data-plane backend the client chose
        self.heartbeat_identity = heartbeat_identity  # named in the hello; events go there, never behind a transfer
        self.requests: OrderedDict[str, dict[str, Any]] = OrderedDict()  # id -> what became of it

    def received(self, request_id: str, kind: str) -> bool:
        """Note a request that will run; False if this id was seen before (it runs at most once)."""
        if request_id in self.requests:
            return False
        self.requests[request_id] = {"state": "running", "type": kind, "received": time.time()}
        while len(self.requests) > REMEMBERED:
            self.requests.popitem(last=False)
        return True

    def finished(self, request_id: str, content: dict[str, Any]) -> None:
        """Its terminal reply went out: `content` has its status (an error reply has none: error)."""
        entry = self.requests.get(request_id)
        if entry is not None:
            entry.update(state="finished", status=str(content.get("status", "error")), finished=time.time(),
                         **({"error": f"{content.get('ename', '')}: {content.get('evalue', '')}"[:500]} if content.get("ename") else {}))

    def ended(self, why: str) -> None:
        """The session is closing: requests still running are stopped with it."""
        for entry in self.requests.values():
            if entry["state"] == "running":
                entry.update(state="stopped", error=f"stopped part-way when the server ended the session ({why})")

    def outcome(self, request_id: str) -> dict[str, Any]:
        """What became of a request: running, finished (with its status), or not received."""
        entry = self.requests.get(request_id)
        return dict(entry) if entry is not None else {"state": "not received"}

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

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id[:8],
            "client": self.client,
            "slot": self.slot,
            "backend": self.backend,
            "created": self.created,
            "idle_s": round(time.monotonic() - self.last_seen, 3),
            "workers": [w.info() for w in self.workers.values()],
        }
