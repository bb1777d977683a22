"""The wire protocol: message types and who sends them, what each contains, the signed codec, the
error map."""

from . import contents
from .codec import (
    PROTOCOL,
    PROTOCOL_VERSION,
    VERSIONS_TAG,
    Codec,
    Message,
    derive_key,
    new_id,
    split_identities,
)
from .errors import error_content, error_from, error_text, remote_error
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
    "contents",
    "derive_key",
    "error_content",
    "error_from",
    "error_text",
    "for_worker",
    "new_id",
    "parse",
    "remote_error",
    "split_identities",
]
