"""The audit log: who ran what (a hash of the code, its size), when, on which node and GPU.
Each session's actor keeps the cells its server ran; they are collected every AUDIT_EVERY
seconds, and once more as the session ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .live import LiveSession
from .registry import Registry

AUDIT_EVERY = 1.0  # seconds between collections


class Audit:
    """`pending`: collections in flight (Ray refs of `take_cells()`) -> whose cells they are."""

    def __init__(self, registry: Registry, node_name: Callable[[str], str]) -> None:
        self.registry = registry
        self.node_name = node_name
        self.pending: dict[Any, LiveSession] = {}
        self.asked_at = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.asked_at < AUDIT_EVERY:
            return False
        self.asked_at = now
        return True

    def ask(self, sessions: dict[str, LiveSession], skip: set[str] | dict[str, Any]) -> None:
        """A collection from every placed session that has none in flight (and is not in `skip`)."""
        busy = {placed.session_id for placed in self.pending.values()}
        for session_id, placed in sessions.items():
            if placed.port and session_id not in busy and session_id not in skip:
                self.pending[placed.actor.take_cells.remote()] = placed

    def take(self, placed: LiveSession, ref: Any, timeout: float | None = None) -> None:
        """A collection's answer, written as the session's user's (none if its actor is going)."""
        import ray

        try:
            cells = ray.get(ref, timeout=timeout)
        except Exception:  # its actor is going; its end is handled by wait_ended
            return
        self.record(placed, cells)

    def record(self, placed: LiveSession, cells: list[dict[str, Any]]) -> None:
        node = self.node_name(placed.node_id)
        for cell in cells:
            self.registry.event("cell", placed.user, placed.session_id, {**cell, "node": node}, at=cell["time"])

    def last(self, placed: LiveSession) -> None:
        """A session ends: the cells a collection in flight took, then the rest."""
        for ref in [r for r, p in self.pending.items() if p is placed]:
            self.take(self.pending.pop(ref), ref, timeout=2.0)
        self.take(placed, placed.actor.take_cells.remote(), timeout=2.0)
