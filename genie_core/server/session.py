"""A client's session on the server: who it is, its workers, and its replay protection."""

from __future__ import annotations

import secrets
import time
from typing import Any

from .worker_process import WorkerProcess


class Session:
    def __init__(self, identity: bytes, client: dict[str, Any], slot: int) -> None:
        self.id = secrets.token_urlsafe(18)  # unguessable: it is half of what binds a client to its worker
        self.identity = identity
        self.client = client
        self.slot = slot
        self.workers: dict[int, WorkerProcess] = {}
        self.last_seen = time.monotonic()
        self.created = time.time()
        self._seqs: dict[bytes, int] = {}
        self.backend = "zmq"  # the data-plane backend the client chose
        self.heartbeat_identity: bytes | None = None  # events go there: never queued behind a transfer

    def accept_seq(self, identity: bytes, seq: int) -> bool:
        """Sequence numbers rise strictly per connection; anything else is a replay."""
        last = self._seqs.get(identity, -1)
        if seq <= last:
            return False
        if identity not in self._seqs and len(self._seqs) >= 4:
            return False  # the main socket and a heartbeat socket, with room for one reconnect
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
