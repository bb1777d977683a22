"""Who waits for GPUs, in what order, and what each user may hold.

Strict FIFO: the head of the queue is placed first, and nobody behind it jumps ahead (a small
request never starves a large one). Ray still picks the node; this only decides when to ask.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .registry import User


class QuotaExceeded(Exception):
    """A request beyond a user's quota; the message names the quota."""


@dataclass
class Ask:
    """One user's request for a session, from the moment it is made until it is placed."""

    session_id: str
    user: str
    name: str
    gpus: int
    deadline: float
    reply_to: bytes  # the requester's connection
    request_id: str
    key: bytes  # signs replies to this user
    asked: float = field(default_factory=time.time)
    accelerator: str = ""  # a GPU type the nodes declare to Ray (`ray start --resources` accelerator_type:T)


def check_quota(user: User, gpus: int, live: list[dict[str, Any]], gpu_hours_today: float) -> None:
    """Raises QuotaExceeded naming the first quota this request would break."""
    if user.max_sessions is not None and len(live) + 1 > user.max_sessions:
        raise QuotaExceeded(
            f"quota: {user.name} may have {user.max_sessions} session(s) at once and has {len(live)} "
            "(end one with %genie_shutdown)"
        )
    held = sum(int(s["gpus"]) for s in live)
    if user.max_gpus is not None and held + gpus > user.max_gpus:
        raise QuotaExceeded(
            f"quota: {user.name} may hold {user.max_gpus} GPU(s) at once; holds or waits for {held}, asked {gpus}"
        )
    if user.gpu_hours_per_day is not None and gpu_hours_today >= user.gpu_hours_per_day:
        raise QuotaExceeded(
            f"quota: {user.name} may use {user.gpu_hours_per_day:g} GPU-hours a day and used "
            f"{gpu_hours_today:.2f} in the last 24 hours"
        )


class Queue:
    """The waiting requests, oldest first."""

    def __init__(self) -> None:
        self._asks: deque[Ask] = deque()

    def __len__(self) -> int:
        return len(self._asks)

    def __iter__(self) -> Iterator[Ask]:
        return iter(self._asks)

    def add(self, ask: Ask) -> int:
        """Queue it; returns how many are ahead of it."""
        self._asks.append(ask)
        return len(self._asks) - 1

    def head(self) -> Ask | None:
        return self._asks[0] if self._asks else None

    def pop_head(self) -> Ask:
        return self._asks.popleft()

    def put_back(self, ask: Ask) -> None:
        """An ask taken from the head whose placement failed before it was answered: first again."""
        self._asks.appendleft(ask)

    def remove(self, session_id: str) -> Ask | None:
        for ask in self._asks:
            if ask.session_id == session_id:
                self._asks.remove(ask)
                return ask
        return None

    def expired(self, now: float) -> list[Ask]:
        gone = [a for a in self._asks if a.deadline <= now]
        for ask in gone:
            self._asks.remove(ask)
        return gone

    def positions(self) -> dict[str, int]:
        return {ask.session_id: i for i, ask in enumerate(self._asks)}
