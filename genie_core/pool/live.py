"""A session the pool has asked Ray for: its actor, where it runs, and who hears about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .queue import Ask


@dataclass
class LiveSession:
    """A session whose actor exists (pending in Ray, or running)."""

    session_id: str
    user: str
    name: str
    gpus: int
    actor: Any
    node_id: str = ""
    host: str = ""
    port: int = 0
    gpu_ids: list[str] = field(default_factory=list)
    watcher: bytes | None = None  # the client connection that hears about this session
    key: bytes = b""
    ask: Ask | None = None  # until its client has been answered
    token: str = ""  # its server's token
    warm: bool = False  # it took a warm session (warm.py), and is placed anew should that fail

    @classmethod
    def asked(cls, ask: Ask, actor: Any, token: str, node_id: str = "", warm: bool = False) -> LiveSession:
        """The session of `ask`, its client still waiting for the answer."""
        return cls(
            ask.session_id,
            ask.user,
            ask.name,
            ask.gpus,
            actor,
            node_id=node_id,
            watcher=ask.reply_to,
            key=ask.key,
            ask=ask,
            token=token,
            warm=warm,
        )
