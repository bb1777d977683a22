"""Framing on a raw data connection: length-prefixed JSON headers, then raw payload bytes
received straight into their destination with `recv_into` (no intermediate copies)."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
from typing import Any, Callable  # noqa: F401 (Callable: the Progress alias)

GREETING = b"GENIE-DATA/1"
CHUNK = 8 << 20


def send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(struct.pack("!I", len(body)) + body)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, CHUNK))
        if n == 0:
            raise ConnectionError("data connection closed mid-transfer")
        got += n


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def recv_header(sock: socket.socket, limit: int = 1 << 20) -> dict[str, Any]:
    (n,) = struct.unpack("!I", recv_exact(sock, 4))
    if n > limit:
        raise ConnectionError(f"header of {n} bytes refused")
    header = json.loads(recv_exact(sock, n))
    if not isinstance(header, dict):
        raise ConnectionError("header is not a JSON object")
    return header


def handshake_mac(key: bytes, nonce: bytes, session: str) -> bytes:
    return hmac.new(key, b"genie data connection\0" + nonce + session.encode(), hashlib.sha256).digest()


class PayloadMacs:
    """One data connection's payload MACs. Each is keyed by the token and bound to the
    connection's nonce, the direction and a transfer counter, so a payload replayed, reordered
    or moved to another connection fails. Both ends call `label`/`start` once per payload."""

    def __init__(self, key: bytes, nonce: bytes, on: bool = True) -> None:
        self.key, self.nonce, self.on = key, nonce, on
        self._counts = {b"up": 0, b"down": 0}

    def label(self, direction: bytes) -> bytes:
        """The next payload's binding (and count it): b"up" is client to server, b"down" back."""
        count = self._counts[direction]
        self._counts[direction] = count + 1
        return b"genie data payload\0" + self.nonce + direction + count.to_bytes(8, "big")

    def start(self, direction: bytes) -> "hmac.HMAC | None":
        label = self.label(direction)
        return hmac.new(self.key, label, hashlib.sha256) if self.on else None


Progress = "Callable[[int, int], None] | None"  # (bytes done, bytes in all)


def send_payload(sock: socket.socket, buffers: list[Any], mac: "hmac.HMAC | None", progress: Progress = None) -> None:
    """Send buffers back to back; with a MAC, hash each chunk as it goes (hashlib and sendall
    both release the GIL) and send the 32-byte digest last."""
    total = sum(memoryview(b).nbytes for b in buffers)
    done = 0
    for b in buffers:
        view = memoryview(b).cast("B")
        for start in range(0, len(view), CHUNK):
            chunk = view[start : start + CHUNK]
            sock.sendall(chunk)
            if mac is not None:
                mac.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    if mac is not None:
        sock.sendall(mac.digest())


def recv_payload_into(sock: socket.socket, view: memoryview, mac: "hmac.HMAC | None", progress: Progress = None, base: int = 0, total: int = 0) -> None:
    for start in range(0, len(view), CHUNK):
        chunk = view[start : start + CHUNK]
        recv_exact_into(sock, chunk)
        if mac is not None:
            mac.update(chunk)
        if progress is not None:
            progress(base + start + len(chunk), total or len(view))
    if mac is not None:
        digest = recv_exact(sock, 32)
        if not hmac.compare_digest(digest, mac.digest()):
            raise ConnectionError("payload failed authentication")


def check_put(sizes: list[int], limit: int) -> None:
    """A put the server will not take: refused before any memory is set aside for it."""
    if any(n < 0 for n in sizes) or sum(sizes) > limit:
        raise ValueError(f"refused a put of {sum(sizes)} bytes (the limit is {limit})")
