"""The live sessions and their Ray actors, from creation to end: an actor up answers its user, an
ended one frees its GPUs, an unreachable one is suspect until Ray's node table says whether its
node died, and a lost one is told to its client."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..protocol import pool as wire
from .audit import Audit
from .intake import Intake
from .live import LiveSession
from .nodes import Nodes
from .queue import Queue
from .registry import Registry
from .session_actor import end_actor

log = logging.getLogger("genie.pool")

DEATH_GRACE = 6.0  # seconds a dead session actor waits for Ray to say whether its node died too
UNREACHABLE_GRACE = 15.0  # seconds a session actor may be unreachable on a live node before we ask again


class SessionActors:
    """`sessions`: session id -> its LiveSession. Ray refs awaited: `placing` (an actor's info(),
    or a warm one's claim()), `ending` (wait_ended()), and the audit's collections."""

    def __init__(
        self,
        *,
        registry: Registry,
        intake: Intake,
        queue: Queue,
        audit: Audit,
        nodes: Nodes,
        free: Callable[[], dict[str, int]],
        read_nodes: Callable[[], None],
    ) -> None:
        self.registry, self.intake, self.queue, self.audit, self.nodes = registry, intake, queue, audit, nodes
        self.free = free  # GPUs free and in all, for the answer to a placed session
        self.read_nodes = read_nodes  # asks Ray's node table now
        self.sessions: dict[str, LiveSession] = {}
        self.placing: dict[Any, str] = {}
        self.ending: dict[Any, str] = {}
        self.unreachable: dict[str, tuple[float, bool]] = {}  # session id -> (since when, dead?)

    def placing_on(self, placed: LiveSession, up: Any) -> None:
        """A session whose actor is being made (or claimed): `up` answers once it is."""
        self.sessions[placed.session_id] = placed
        self.placing[up] = placed.session_id

    def running(self, placed: LiveSession) -> None:
        """A session whose actor is up (one an earlier endpoint left): its end is awaited."""
        self.sessions[placed.session_id] = placed
        self.ending[placed.actor.wait_ended.remote()] = placed.session_id

    def collect(self) -> None:
        """Actors that came up (answer their users), sessions that ended (free their GPUs), cells ran."""
        import ray

        refs = list(self.placing) + list(self.ending) + list(self.audit.pending)
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:  # a session's end takes its audit refs too: one later in `ready` is gone
            if ref in self.placing:
                self._on_up(self.placing.pop(ref), ref)
            elif ref in self.audit.pending:
                self.audit.take(self.audit.pending.pop(ref), ref)
            elif ref in self.ending:
                self._on_ended(self.ending.pop(ref), ref)

    def expire(self, now: float) -> None:
        """Sessions whose users were not answered by their deadline end."""
        for placed in [p for p in list(self.sessions.values()) if p.ask is not None and p.ask.deadline <= now]:
            self.forget(placed, "Ray did not place it in time (other work holds the GPUs it needs)")

    def _on_up(self, session_id: str, ref: Any) -> None:
        import ray

        placed = self.sessions.get(session_id)
        if placed is None:
            return
        try:
            info = ray.get(ref)
        except Exception as exc:
            if placed.warm and placed.ask is not None:
                self.place_anew(placed, f"{type(exc).__name__}: {exc}"[:200])
                return
            self.forget(placed, f"its actor failed to start: {type(exc).__name__}: {exc}"[:500])
            return
        placed.node_id, placed.host, placed.port = info["node_id"], info["host"], info["port"]
        placed.gpu_ids = list(info["gpu_ids"])
        self.registry.session_placed(session_id, placed.node_id, placed.host, placed.gpu_ids)
        node = self.nodes.name(placed.node_id, placed.node_id)
        self.registry.event("placed", placed.user, session_id, {"node": node, "gpu_ids": placed.gpu_ids})
        self.ending[placed.actor.wait_ended.remote()] = session_id
        if placed.ask is not None:
            ask, placed.ask = placed.ask, None
            self.intake.answer(
                ask,
                {
                    "kind": "placed",
                    "session": session_id,
                    "host": placed.host,
                    "port": placed.port,
                    "token": wire.seal(placed.token, ask.key, ask.request_id),
                    "node": self.nodes.name(placed.node_id, placed.node_id[:12]),
                    "node_id": placed.node_id,
                    "gpu_ids": placed.gpu_ids,
                    "gpu_names": info.get("gpus", []),
                    "waited": round(time.time() - ask.asked, 3),
                    **self.free(),
                },
            )

    def _on_ended(self, session_id: str, ref: Any) -> None:
        import ray
        from ray.exceptions import ActorUnavailableError

        placed = self.sessions.get(session_id)
        if placed is None:
            return
        try:
            reason = str(ray.get(ref))
        except Exception as exc:
            # Unreachable, or dead: its process, or its whole node. Ray's node table tells which
            # within seconds (see head.HEALTH_CHECKS); until it does, the session is only suspect.
            self.unreachable[session_id] = (time.monotonic(), not isinstance(exc, ActorUnavailableError))
            self.read_nodes()
            return
        try:  # the last cells, before the actor goes
            self.audit.last(placed)
        finally:
            self.forget(placed, reason)

    def recheck_unreachable(self) -> None:
        """Suspect sessions on nodes Ray still calls alive: past a grace, a dead actor is a dead
        process, and an unreachable one is asked again."""
        for session_id, (since, dead) in list(self.unreachable.items()):
            placed = self.sessions.get(session_id)
            waited = time.monotonic() - since
            if placed is None:
                self.unreachable.pop(session_id)
            elif dead and waited > DEATH_GRACE:
                self.unreachable.pop(session_id)
                self.lost(placed, "its process died (its node is alive)")
            elif not dead and waited > UNREACHABLE_GRACE:
                self.unreachable.pop(session_id)
                self.ending[placed.actor.wait_ended.remote()] = session_id

    def node_died(self, node_id: str, name: str) -> None:
        """Its sessions are lost (or placed anew, when their users were not answered yet)."""
        for placed in [p for p in self.sessions.values() if p.node_id == node_id]:
            if placed.warm and placed.ask is not None:
                self.place_anew(placed, f"node {name} left the pool")
            else:
                self.lost(placed, f"node {name} left the pool (Ray reports it dead)")

    def lost(self, placed: LiveSession, reason: str) -> None:
        if placed.watcher is not None:
            notice = {"kind": "session_lost", "session": placed.session_id, "reason": reason}
            self.intake.send(placed.watcher, placed.key, notice)
        self.forget(placed, reason, lost=True)

    def place_anew(self, placed: LiveSession, why: str) -> None:
        """A warm session failed before its user was answered (its process or node died unseen):
        the ask goes back to the head of the queue, to a warm session elsewhere or a new actor."""
        log.warning("a warm session could not be taken (%s); placing session %s anew", why, placed.session_id)
        self.sessions.pop(placed.session_id, None)
        self._drop_refs(placed.session_id)
        end_actor(placed.actor)
        assert placed.ask is not None
        self.queue.put_back(placed.ask)

    def _drop_refs(self, session_id: str) -> None:
        """Nobody waits any more for the session's actor to come up or to end."""
        for refs in (self.placing, self.ending):
            for ref in [r for r, s in refs.items() if s == session_id]:
                refs.pop(ref)

    def forget(self, placed: LiveSession, reason: str, lost: bool = False) -> None:
        """The session is over: its actor goes (Ray frees its GPUs), and the queue may move."""
        end_actor(placed.actor)
        self._drop_refs(placed.session_id)
        try:  # recorded before its GPUs show free: whoever sees them free also finds why they freed
            self.registry.session_ended(placed.session_id, reason)
            self.registry.event("lost" if lost else "ended", placed.user, placed.session_id, {"reason": reason})
        finally:
            self.sessions.pop(placed.session_id, None)
        if placed.ask is not None:
            self.intake.answer(placed.ask, {"kind": "error", "error": f"the session could not start: {reason}"})
