"""Requests in and answers out on the pool endpoint's socket. A request is taken only when it is
signed with its user's token and fresh (not a replay); every answer is signed for its user."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import zmq

from ..protocol import VERSIONS_TAG
from ..protocol import pool as wire
from ..version import __version__
from .queue import Ask
from .registry import Registry, User

log = logging.getLogger("genie.pool")


@dataclass
class Incoming:
    """An authenticated request: who sent it, on which connection, and the key its answers are signed with."""

    identity: bytes
    request: dict[str, Any]
    user: User
    key: bytes


class Intake:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.replays = wire.Replays()
        self.router: zmq.Socket[Any] | None = None

    def bind(self, ctx: zmq.Context[Any], ip: str, port: int) -> int:
        """The endpoint's ROUTER socket on `ip:port` (0: any free port); returns the port."""
        self.router = ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.maxmsgsize = wire.MAX_REQUEST_BYTES * 4
        if port == 0:
            return int(self.router.bind_to_random_port(f"tcp://{ip}"))
        self.router.bind(f"tcp://{ip}:{port}")
        return port

    def receive(self, frames: list[bytes]) -> Incoming | None:
        """The request in `frames`, or None when there is none to serve (those refused are told why,
        except a replay, whose original was answered, and what cannot be parsed)."""
        assert self.router is not None
        identity = frames[0]
        if len(frames) >= 2 and frames[1].startswith(b"genie/") and len(frames[1]) <= 16:
            # A genie client's hello: this is a pool, not a server. Say so in the version-neutral frame.
            answer = {"protocol": wire.PROTOCOL, "genie": __version__, "pool": "true"}
            self.router.send_multipart([identity, VERSIONS_TAG, json.dumps(answer).encode()])
            return None
        if len(frames) != 2 or len(frames[1]) > wire.MAX_REQUEST_BYTES:
            return None
        try:
            request = json.loads(frames[1])
            user = self.registry.user(str(request["user"]))
        except (ValueError, KeyError, TypeError):
            return None
        key = wire.verify_request(request, user.stored_key) if user is not None else None
        if user is None or key is None:
            log.warning("refused a request signed with no user's token (user %r)", str(request.get("user"))[:40])
            refusal = {"re": request.get("id"), "kind": "refused", "error": "unknown user or wrong token"}
            self.router.send_multipart([identity, json.dumps(refusal).encode()])
            return None
        why = self.replays.fresh(request)
        if why:
            log.warning("refused %s from %s", why, user.name)
            if "replayed" not in why:  # a replay's original was answered; a stale request is told why
                self.send(identity, key, {"re": request.get("id"), "kind": "error", "error": f"refused {why}"})
            return None
        return Incoming(identity, request, user, key)

    def send(self, identity: bytes, key: bytes, reply: dict[str, Any]) -> None:
        assert self.router is not None
        try:
            self.router.send_multipart([identity, json.dumps(wire.sign_reply(reply, key)).encode()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.info("could not answer a client: %s", exc)

    def answer(self, ask: Ask, reply: dict[str, Any]) -> None:
        """The reply to the request that made `ask`."""
        self.send(ask.reply_to, ask.key, {"re": ask.request_id, **reply})
