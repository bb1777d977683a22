"""The wire protocol: message types and who sends them, the signed codec, the error map."""

from .codec import (
    PROTOCOL,
    PROTOCOL_VERSION,
    VERSIONS_TAG,
    Codec,
    Message,
    chunk_digests,
    derive_key,
    new_id,
    split_identities,
)
from .errors import error_content, error_from, error_text
from .messages import RUNS, TABLE, TERMINAL, MessageType, Peer, accepted_from, for_worker, parse

__all__ = [
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "RUNS",
    "TABLE",
    "TERMINAL",
    "VERSIONS_TAG",
    "Codec",
    "Message",
    "MessageType",
    "Peer",
    "accepted_from",
    "chunk_digests",
    "derive_key",
    "error_content",
    "error_from",
    "error_text",
    "for_worker",
    "new_id",
    "parse",
    "split_identities",
]
