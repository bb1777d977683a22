"""The pool's front door: signed JSON requests and replies between a user and `genie pool up`.

A user proves their token without sending it, and the pool checks the proof without storing it,
as SCRAM does: the pool keeps only `stored = SHA-256(client_key)` where
`client_key = HMAC(token, "genie-pool client key")`. A request carries
`proof = client_key XOR HMAC(stored, request)`; the pool recomputes the HMAC, recovers
`client_key` and checks its hash. The registry alone lets nobody sign requests; the registry and
one request seen on the network together do (no server nonce, no encryption), so keep the
registry as secret as the tokens and the pool's port on a trusted network. Replies are signed with
`client_key`, and a session's token travels sealed with it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import deque
from typing import Any

PROTOCOL = "genie-pool/1"
FRESH_SECONDS = 300.0  # a request is taken only this close to its timestamp (and once: see Replays)
MAX_REQUEST_BYTES = 64 << 10


def client_key(token: str) -> bytes:
    """The key a token stands for: it signs replies and unseals session tokens."""
    return hmac.new(token.encode(), b"genie-pool client key", hashlib.sha256).digest()


def stored_key(token: str) -> str:
    """What the registry keeps of a user's token (hex)."""
    return hashlib.sha256(client_key(token)).hexdigest()


def _canonical(message: dict[str, Any], without: str) -> bytes:
    return json.dumps({k: v for k, v in message.items() if k != without}, sort_keys=True).encode()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def sign_request(user: str, token: str, op: str, **args: Any) -> tuple[dict[str, Any], bytes]:
    """A request ready to send, and the key that checks its replies."""
    key = client_key(token)
    request = {"user": user, "op": op, "id": secrets.token_hex(12), "ts": time.time(), "args": args}
    signature = hmac.new(bytes.fromhex(stored_key(token)), _canonical(request, "proof"), hashlib.sha256).digest()
    request["proof"] = _xor(key, signature).hex()
    return request, key


def verify_request(request: dict[str, Any], stored: str) -> bytes | None:
    """The user's client key when the proof matches their stored key, else None."""
    try:
        proof = bytes.fromhex(str(request["proof"]))
        signature = hmac.new(bytes.fromhex(stored), _canonical(request, "proof"), hashlib.sha256).digest()
        key = _xor(proof, signature)
    except (KeyError, ValueError, TypeError):
        return None
    return key if hmac.compare_digest(hashlib.sha256(key).hexdigest(), stored) else None


def sign_reply(reply: dict[str, Any], key: bytes) -> dict[str, Any]:
    """The pool's answer, with a MAC its user can check (so nobody else can answer for the pool)."""
    reply = dict(reply)
    reply["mac"] = hmac.new(key, _canonical(reply, "mac"), hashlib.sha256).hexdigest()
    return reply


def reply_is_genuine(reply: dict[str, Any], key: bytes) -> bool:
    """Whether the pool signed this reply for the holder of `key`."""
    expected = hmac.new(key, _canonical(reply, "mac"), hashlib.sha256).hexdigest()
    return hmac.compare_digest(str(reply.get("mac", "")), expected)


def _pad(key: bytes, request_id: str, size: int) -> bytes:
    out = b""
    counter = 0
    while len(out) < size:
        out += hmac.new(key, f"seal:{request_id}:{counter}".encode(), hashlib.sha256).digest()
        counter += 1
    return out[:size]


def seal(secret: str, key: bytes, request_id: str) -> str:
    """A session token for one user's eyes: XOR with a pad only their client key makes."""
    data = secret.encode()
    return _xor(data, _pad(key, request_id, len(data))).hex()


def unseal(sealed: str, key: bytes, request_id: str) -> str:
    """The session token `seal` hid."""
    data = bytes.fromhex(sealed)
    return _xor(data, _pad(key, request_id, len(data))).decode()


class Replays:
    """Request ids seen within the freshness window: a recorded request replayed is refused."""

    def __init__(self, window: float = FRESH_SECONDS) -> None:
        self.window = window
        self._seen: set[str] = set()
        self._order: deque[tuple[float, str]] = deque()  # (when seen, id), oldest first

    def fresh(self, request: dict[str, Any]) -> str:
        """'' when the request may run, else why not."""
        now = time.time()
        while self._order and now - self._order[0][0] > self.window:
            self._seen.discard(self._order.popleft()[1])
        try:
            age = now - float(request["ts"])
            request_id = str(request["id"])
        except (KeyError, TypeError, ValueError):
            return "a request without an id or timestamp"
        if abs(age) > self.window:
            return f"a request {age:.0f} s old (are the clocks of this machine and the pool's {abs(age):.0f} s apart?)"
        if request_id in self._seen:
            return "a replayed request"
        self._seen.add(request_id)
        self._order.append((now, request_id))
        return ""
