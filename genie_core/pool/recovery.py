"""A restarted endpoint finds the sessions the last one left: their actors are detached, so they
outlive it; the registry's rows without an actor are ended."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from .live import LiveSession
from .registry import Registry
from .session_actor import NAMESPACE, PREFIX, end_actor

log = logging.getLogger("genie.pool")


def recover(registry: Registry) -> list[LiveSession]:
    """The sessions whose actors answer (unanswering ones are killed; the last endpoint's warm
    sessions, nobody's, are ended to be warmed afresh)."""
    import ray

    found: list[LiveSession] = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != NAMESPACE or not str(entry.get("name", "")).startswith(PREFIX):
            continue
        try:
            actor = ray.get_actor(entry["name"], namespace=NAMESPACE)
            info: dict[str, Any] = dict(ray.get(actor.info.remote(), timeout=10))
        except Exception as exc:
            log.warning("session actor %s did not answer: %s; ending it", entry["name"], exc)
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
            continue
        if info.get("session") == "":
            end_actor(actor)
            continue
        session_id = str(info.get("session") or entry["name"][len(PREFIX) :])  # an older actor's: its name
        known = [s for s in registry.sessions() if s["id"] == session_id]
        row: dict[str, Any] = known[0] if known else {"user": "?", "name": "", "gpus": len(info["gpu_ids"])}
        found.append(
            LiveSession(
                session_id,
                row["user"],
                row["name"],
                int(row["gpus"]),
                actor,
                info["node_id"],
                info["host"],
                info["port"],
                list(info["gpu_ids"]),
            )
        )
        log.info("recovered session %s of %s", session_id, row["user"])
    kept = {placed.session_id for placed in found}
    for row in registry.sessions():
        if row["id"] not in kept:
            registry.session_ended(row["id"], "the pool endpoint restarted and it had no actor")
    return found
