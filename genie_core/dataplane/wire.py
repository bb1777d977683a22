"""What crosses a raw data connection (tcp, ucx): a greeting with a nonce, JSON headers, and raw
payload bytes, with a MAC that binds each payload to its connection, direction and order."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

from ..protocol.codec import CHUNK as MAC_CHUNK  # bytes per GMAC tag (4 MiB), as messages' buffers have
from ..protocol.codec import gmac, gmac_tags
from .hashing import hashed_soon

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

GREETING = b"GENIE-DATA/3"  # 3: payloads tagged with GMAC, both ends' nonces (2: SHA-256 digests, the server's)
NONCE = 32  # bytes of each end's nonce: a connection is bound to both
CHUNK = 8 << 20  # bytes per socket call; a multiple of the MAC's chunks
Progress = Callable[[int, int], None] | None  # (bytes done, bytes in all)


def handshake_mac(key: bytes, nonce: bytes, session: str) -> bytes:
    """The client's proof that it holds the token, for this connection's nonces and session."""
    return hmac.new(key, b"genie data connection\0" + nonce + session.encode(), hashlib.sha256).digest()


class PayloadMac:
    """One payload's MAC: an HMAC over the GMAC tags of its 4 MiB chunks (protocol/codec.py's
    gmac_tags; GMAC runs at AES-NI's speed, about 7 times SHA-256's here, and cryptography's AEAD
    calls release the GIL in the releases measured, 50), so a transfer tags the pieces it has moved
    on the hashing pool while it moves the next. Every chunk's GCM nonce is its own (direction,
    payload number, chunk number) under a key of the connection's. Pieces must be cut at multiples
    of 4 MiB, except the last piece of each buffer; a piece is never empty (stream.cut)."""

    def __init__(self, key: bytes, label: bytes, gmac: AESGCM, nonce_prefix: bytes) -> None:
        self.key, self.label = key, label
        self._gmac, self._prefix = gmac, nonce_prefix
        self._chunks = 0  # chunks tagged so far: the next one's number
        self.tags: list[bytes | Future[bytes]] = []

    def update(self, piece: Any) -> None:
        """Tag `piece` in the background (kept unchanged and alive until `digest` or `abandon`)."""
        view = memoryview(piece).cast("B")
        first = self._chunks
        self._chunks += -(-len(view) // MAC_CHUNK)
        self.tags.append(hashed_soon(lambda v: self._tags(v, first), view))

    def _tags(self, view: memoryview, first: int) -> bytes:
        return gmac_tags(self._gmac, self._prefix, view, first)

    def abandon(self) -> None:
        """The transfer failed: drop the hashing not yet begun and wait for the hashing under way,
        so that no hashing thread reads the payload's memory once the error is out."""
        pending = [t for t in self.tags if isinstance(t, Future)]
        for tag in pending:
            tag.cancel()
        wait(pending)

    def digest(self) -> bytes:
        joined = b"".join(t if isinstance(t, bytes) else t.result() for t in self.tags)
        return hmac.new(self.key, self.label + joined, hashlib.sha256).digest()


class PayloadMacs:
    """A connection's payload MACs, keyed by the token and bound to the connection's nonces (the
    server's and the client's, so neither end can be replayed a side recorded earlier), the
    direction and a transfer counter, so a payload replayed, reordered or moved to another
    connection fails. Both ends call `start` once per payload, in the same order."""

    def __init__(self, key: bytes, nonce: bytes, on: bool = True) -> None:
        self.key, self.nonce, self.on = key, nonce, on
        self._counts = {b"up": 0, b"down": 0}
        self._gmac = gmac(hmac.new(key, b"genie data gmac key\0" + nonce, hashlib.sha256).digest()) if on else None

    def start(self, direction: bytes) -> PayloadMac | None:
        """The next payload's MAC (None when off): b"up" is client to server, b"down" back."""
        count = self._counts[direction]
        self._counts[direction] = count + 1
        if self._gmac is None:
            return None
        label = b"genie data payload\0" + self.nonce + direction + count.to_bytes(8, "big")
        prefix = (b"u" if direction == b"up" else b"d") + count.to_bytes(7, "big")  # + 4 bytes of chunk number
        return PayloadMac(self.key, label, self._gmac, prefix)


def encode_header(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def decode_header(data: bytes, limit: int) -> dict[str, Any]:
    if len(data) > limit:
        raise ConnectionError(f"header of {len(data)} bytes refused")
    header = json.loads(data)
    if not isinstance(header, dict):
        raise ConnectionError("header is not a JSON object")
    return header


def check_put(sizes: list[int], limit: int) -> None:
    """A put the server will not take: refused before any memory is set aside for it."""
    if any(n < 0 for n in sizes) or sum(sizes) > limit:
        raise ValueError(f"refused a put of {sum(sizes)} bytes (the limit is {limit})")


# -- plain sockets (the tcp backend) -----------------------------------------------------------


def send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    body = encode_header(header)
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
    return decode_header(recv_exact(sock, n), limit)
