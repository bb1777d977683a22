"""What `genie pool status`, `%genie_status` and the pool dashboard show: nodes, their GPUs and
who holds them, and the queue. Session names are their owner's to see."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from .live import LiveSession
from .nodes import Nodes
from .queue import Ask


def pool_status(
    sessions: Iterable[LiveSession],
    nodes: Nodes,
    warm: dict[str, list[str]],
    queue: Iterable[Ask],
    free: dict[str, int],
    viewer: str | None = None,
) -> dict[str, Any]:
    """`warm`: node id -> the free GPUs a warm session holds; `viewer`: the user asking (None: all)."""
    holders: dict[str, list[dict[str, Any]]] = {}
    for placed in list(sessions):  # a copy: status may be asked from other threads
        holders.setdefault(placed.node_id, []).append(
            {
                "user": placed.user,
                "gpu_ids": placed.gpu_ids,
                **({"session": placed.session_id, "name": placed.name} if viewer in (None, placed.user) else {}),
            }
        )
    now = time.time()
    shown = []
    for nid, node in sorted(nodes.table.items(), key=lambda kv: kv[1]["name"]):  # sorted() copies first
        reading = nodes.readings.get(nid) or {}
        shown.append(
            {
                "id": nid,
                **node,
                "sessions": holders.get(nid, []),
                "warm": warm.get(nid, []),  # a free GPU a warm session holds for the next user
                "health": reading.get("health"),
                "gpu_readings": reading.get("gpus", []),
                "simulated": reading.get("simulated", False),
                "reading_age_s": round(now - reading["time"], 1) if reading else None,
            }
        )
    waiting = [
        {
            "user": a.user,
            "gpus": a.gpus,
            "waiting_s": round(now - a.asked, 1),
            **({"session": a.session_id} if viewer in (None, a.user) else {}),
        }
        for a in list(queue)
    ]
    return {"nodes": shown, "queue": waiting, **free}
