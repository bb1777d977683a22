"""Wire format: `[ident…] b"genie/4" signature header content buffer*`.

The signature is HMAC-SHA256 over header, content *and* every buffer, with a key derived
from the server token. Header and content are small JSON; buffers are raw bytes (tensor and
array data) that are never pickled and travel zero-copy. A buffer enters the HMAC by its 4 MiB
chunks: a buffer under 1 MiB as their SHA-256 digests, a larger one as their GMAC tags (AES-GCM
over no plaintext, at AES-NI's speed: about 7 times SHA-256's here), under a key of the message's
own (derived from the signing key and the header, whose id is fresh for every message) and a
nonce per chunk (the buffer's place, the chunk's), so signing a large tensor costs little beside
moving it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import BadSignature, ProtocolError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PROTOCOL = b"genie/4"
# The first frame of the one answer that every protocol version shares: "I speak another version; here
# are mine" (JSON in the second frame), so either side can say what to install. Never changes.
VERSIONS_TAG = b"genie-versions"
PROTOCOL_VERSION = 4  # 4: large buffers signed by GMAC tags; 3: op records name tensors by bytes, a batch its answer
_KEY_CONTEXT = b"genie message signing v1"
_GMAC_CONTEXT = b"genie message buffers gmac\0"
CHUNK = 4 << 20  # bytes of buffer per digest or tag
GMAC_FROM = 1 << 20  # buffers at least this big enter the signature by GMAC tags, smaller ones by digests


def gmac_tags(tagger: AESGCM, prefix: bytes, buffer: Any, first: int = 0) -> bytes:
    """The GMAC tag (AES-GCM over no plaintext) of each CHUNK of `buffer`, each under its own nonce:
    `prefix` and then the chunk's number, counted from `first`, in the nonce's other bytes. The
    tags never leave an HMAC (a message's signature, a payload's MAC)."""
    view = memoryview(buffer).cast("B")
    width = 12 - len(prefix)
    return b"".join(
        tagger.encrypt(prefix + (first + i).to_bytes(width, "big"), b"", view[start : start + CHUNK])
        for i, start in enumerate(range(0, len(view), CHUNK))
    )


def gmac(key: bytes) -> AESGCM:
    """AES-GCM under `key` (32 bytes), for gmac_tags."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # (on first use: `import genie_core` stays light)

    return AESGCM(key)


def derive_key(token: str) -> bytes:
    """The signing key: never the token itself, so a leaked key does not reveal the token."""
    return hmac.new(token.encode(), _KEY_CONTEXT, hashlib.sha256).digest()


def new_id() -> str:
    return os.urandom(12).hex()


@dataclass
class Message:
    type: str
    content: Mapping[str, Any] = field(default_factory=dict)  # its shape: protocol/contents.py
    buffers: list[Any] = field(default_factory=list)
    parent: str = ""
    session: str = ""
    seq: int = 0
    id: str = field(default_factory=new_id)
    time: float = field(default_factory=time.time)

    def header(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "parent": self.parent,
            "session": self.session,
            "seq": self.seq,
            "time": self.time,
        }


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=str).encode()


class Codec:
    """Packs and unpacks messages. `key=None` means unsigned: only for the server's private
    worker channel (a Unix socket in a 0700 folder), never for a network socket."""

    def __init__(self, key: bytes | None, max_bytes: int | None = None) -> None:
        self.key = key
        self.max_bytes = max_bytes

    def sign(self, parts: Sequence[Any]) -> bytes:
        """parts: header, content, buffers... Each enters with its length; a buffer by its chunks'
        GMAC tags (from GMAC_FROM bytes) or its digest."""
        if self.key is None:
            return b""
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        tagger = None
        for index, part in enumerate(parts):
            mac.update(len(part).to_bytes(8, "little"))
            if index < 2:
                mac.update(part)
            elif len(part) < GMAC_FROM:  # one chunk at most: its SHA-256 digest
                mac.update(hashlib.sha256(part).digest())
            else:
                if tagger is None:  # a key of the message's own, from its header (a fresh id each)
                    tagger = gmac(hmac.new(self.key, _GMAC_CONTEXT + bytes(parts[0]), hashlib.sha256).digest())
                mac.update(gmac_tags(tagger, index.to_bytes(4, "big"), part))
        return mac.hexdigest().encode()

    def pack(self, msg: Message) -> list[Any]:
        header = _dumps(msg.header())
        content = _dumps(msg.content)
        buffers = [memoryview(b).cast("B") if not isinstance(b, bytes) else b for b in msg.buffers]
        return [PROTOCOL, self.sign([header, content, *buffers]), header, content, *buffers]

    def unpack(self, frames: Sequence[Any], verify: bool = True) -> Message:
        """Frames after the routing identities. Raises ProtocolError on anything off."""
        if len(frames) < 4:
            raise ProtocolError(f"message has {len(frames)} frames; at least 4 expected")
        parts = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        if bytes(parts[0]) != PROTOCOL:
            raise ProtocolError(f"unknown protocol {bytes(parts[0])[:16]!r}")
        if self.max_bytes is not None and sum(len(p) for p in parts) > self.max_bytes:
            raise ProtocolError("message larger than the configured maximum")
        header_b, content_b, buffers = parts[2], parts[3], parts[4:]
        if verify and self.key is not None:
            expected = self.sign([header_b, content_b, *buffers])
            if not hmac.compare_digest(expected, bytes(parts[1])):
                raise BadSignature("bad signature")
        try:
            header = json.loads(bytes(header_b))
            content = json.loads(bytes(content_b))
            if not isinstance(header, dict) or not isinstance(content, dict):
                raise ValueError("header and content must be JSON objects")
            return Message(
                type=str(header["type"]),
                content=content,
                buffers=list(buffers),
                parent=str(header["parent"]),
                session=str(header["session"]),
                seq=int(header["seq"]),
                id=str(header["id"]),
                time=float(header["time"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed message: {exc}") from None


def split_identities(frames: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """ROUTER frames -> (routing identities, message frames starting at the protocol tag)."""
    for i, frame in enumerate(frames):
        data = frame.bytes if hasattr(frame, "bytes") and len(frame) == len(PROTOCOL) else frame
        if isinstance(data, (bytes, bytearray)) and bytes(data) == PROTOCOL:
            return list(frames[:i]), list(frames[i:])
    raise ProtocolError("no protocol tag in message")
