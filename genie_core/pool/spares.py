"""Warm sessions: one session actor per node, started ahead and holding one GPU, for the next user.

Ray starts a fresh worker process for every actor, which takes seconds; a session that takes a
spare skips it (its server is already up). A spare's GPU counts as free: it is the next user's.
Ray still places every spare (pinned to its node) and every session that no spare fits; spares
on the nodes such a session could use are ended first, so that Ray has their GPUs to give.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("genie.pool")


@dataclass
class Spare:
    """A session actor nobody holds yet: `up` is its info() ref until it answers."""

    node_id: str
    actor: Any
    token: str
    name: str  # its actor's name (s:<id>); the session that takes it keeps its own id
    up: Any = None
    gpu_ids: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.up is None


class Spares:
    """At most one spare per node. `start(node_id, name, token)` makes the actor (the endpoint's)."""

    def __init__(self, start: Callable[[str, str, str], Any], enabled: bool = True) -> None:
        self.start = start
        self.enabled = enabled
        self.by_node: dict[str, Spare] = {}

    def warm(self, free_by_node: dict[str, int]) -> None:
        """A spare on each node with a GPU free and none yet. The endpoint calls it only while
        nothing waits for Ray: a spare must not take the GPU that a pending session needs."""
        if not self.enabled:
            return
        for node_id, free in free_by_node.items():
            if free >= 1 and node_id not in self.by_node:
                name, token = secrets.token_hex(8), secrets.token_hex(24)
                actor = self.start(node_id, name, token)
                self.by_node[node_id] = Spare(node_id, actor, token, name, up=actor.info.remote())

    def collect(self) -> None:
        """Spares that came up are ready; one that failed to start is dropped (warmed again later)."""
        import ray

        warming = {s.up: s for s in self.by_node.values() if s.up is not None}
        if not warming:
            return
        done, _ = ray.wait(list(warming), num_returns=len(warming), timeout=0)
        for ref in done:
            spare = warming[ref]
            try:
                spare.gpu_ids = [str(g) for g in ray.get(ref)["gpu_ids"]]
                spare.up = None
            except Exception as exc:
                log.warning("a spare session on node %s did not start: %s", spare.node_id[:12], exc)
                self.end(spare.node_id)

    def take(self, nodes: Iterable[str]) -> Spare | None:
        """A spare on one of `nodes`, ready ones first: it is the caller's now. One still starting
        answers its claim as soon as it is up, sooner than a new actor would."""
        mine = [self.by_node[n] for n in nodes if n in self.by_node] if self.enabled else []
        if not mine:
            return None
        spare = min(mine, key=lambda s: not s.ready)
        return self.by_node.pop(spare.node_id)

    def make_room(self, nodes: list[str], free: dict[str, int], gpus: int) -> None:
        """A session that no spare fits is about to be asked of Ray. If no node of `nodes` has
        `gpus` free beside its spare, the spares there go, so that Ray can give their GPUs."""
        if not any(free[n] - (n in self.by_node) >= gpus for n in nodes):
            self.end_all([n for n in nodes if n in self.by_node])

    def end(self, node_id: str) -> None:
        """End the spare on `node_id` (Ray frees its GPU)."""
        import ray

        spare = self.by_node.pop(node_id, None)
        if spare is not None:
            try:
                ray.kill(spare.actor, no_restart=True)
            except Exception as exc:  # gone with its node
                log.debug("spare on %s: %s", node_id[:12], exc)

    def end_all(self, nodes: Iterable[str] | None = None) -> None:
        for node_id in list(self.by_node if nodes is None else nodes):
            self.end(node_id)

    def ready_gpus(self) -> dict[str, list[str]]:
        """Node id -> the GPUs its ready spare holds (shown as free, and warm)."""
        return {nid: s.gpu_ids for nid, s in list(self.by_node.items()) if s.ready}
