"""Where a session can go: GPUs free per node, the nodes an ask fits, and why an ask can never
fit. Arithmetic over the node table and the live sessions; Ray still picks the node."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .live import LiveSession
from .queue import Ask


def free_by_node(table: dict[str, dict[str, Any]], sessions: Iterable[LiveSession]) -> dict[str, int]:
    """GPUs free on each live node. A session not placed yet counts against the node with the
    most room. (A simulated node, the benchmark's, only reports readings: nothing goes there.)"""
    free = {nid: n["gpus"] for nid, n in list(table.items()) if n["alive"] and not n.get("simulated")}
    for placed in list(sessions):
        if placed.node_id in free:
            free[placed.node_id] -= placed.gpus
        elif free:
            most = max(free, key=lambda nid: free[nid])
            free[most] -= placed.gpus
    return free


def free_and_total(table: dict[str, dict[str, Any]], sessions: Iterable[LiveSession]) -> dict[str, int]:
    """What every answer to a user says of the pool: GPUs free and GPUs in all."""
    free = free_by_node(table, sessions)
    total = sum(n["gpus"] for n in list(table.values()) if n["alive"] and not n.get("simulated"))
    return {"free": max(0, sum(free.values())), "total": total}


def fits(ask: Ask, free: dict[str, int], table: dict[str, dict[str, Any]]) -> list[str]:
    """The nodes with room for the ask now (of its GPU type, if it names one)."""
    found = [nid for nid, n in free.items() if n >= ask.gpus]
    if ask.accelerator:
        found = [nid for nid in found if ask.accelerator in table[nid].get("accelerators", [])]
    return found


def never_fits(table: dict[str, dict[str, Any]], gpus: int, accelerator: str) -> str | None:
    """Why no node of the pool could ever hold this ask (None when one could)."""
    alive = [n for n in table.values() if n["alive"]]
    largest = max((n["gpus"] for n in alive), default=0)
    if gpus < 1:
        return f"a pool session holds 1 GPU or more (asked {gpus})"
    if accelerator:
        kinds = sorted({a for n in alive for a in n.get("accelerators", [])})
        if accelerator not in kinds:
            return (
                f"no node of this pool has {accelerator} GPUs "
                f"(it has: {', '.join(kinds) or 'no GPUs of a declared type'})"
            )
        largest = max(n["gpus"] for n in alive if accelerator in n.get("accelerators", []))
    if gpus > largest:
        return f"no node of this pool has {gpus} GPUs (the largest has {largest})"
    return None
