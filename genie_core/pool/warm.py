"""Warm sessions: one session actor per node, started ahead and holding one GPU, for the next user.

Ray starts a fresh worker process for every actor, which takes seconds; a one-GPU session that
takes a warm one skips it (its server is already up). A warm session's GPU counts as free: it is
the next user's. Ray still places each one (pinned to its node) and every session that none fits;
when such a session fits no node beside its warm one, one warm session ends first, so that Ray
has its GPU to give.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .session_actor import end_actor

log = logging.getLogger("genie.pool")

START_WITHIN = 120.0  # seconds a warm session may take to come up before it is ended
RETRY_FIRST, RETRY_MOST = 5.0, 300.0  # seconds before warming a node again after a failure, doubling


@dataclass
class WarmSession:
    """A session actor nobody holds yet. `up`: its info() ref until it answers; then `watch`: a
    call that returns when it is claimed, or fails when its process dies."""

    node_id: str
    actor: Any
    token: str
    started: float
    up: Any = None
    watch: Any = None
    gpu_ids: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.up is None


class WarmSessions:
    """At most one a node. `start(node_id, name, token)` makes the actor (the endpoint knows how)."""

    def __init__(self, start: Callable[[str, str, str], Any], enabled: bool = True) -> None:
        self.start = start
        self.enabled = enabled
        self.by_node: dict[str, WarmSession] = {}
        self._retry: dict[str, tuple[float, float]] = {}  # node id -> (not before, next wait) after a failure

    def warm(self, free_by_node: dict[str, int]) -> None:
        """One on each node with a GPU free and none yet. The endpoint calls it only while nothing
        waits for Ray: a warm session must not take the GPU that a pending session needs."""
        if not self.enabled:
            return
        now = time.monotonic()
        for node_id, free in free_by_node.items():
            if free >= 1 and node_id not in self.by_node and self._retry.get(node_id, (0.0, 0.0))[0] <= now:
                token = secrets.token_hex(24)
                actor = self.start(node_id, secrets.token_hex(8), token)
                self.by_node[node_id] = WarmSession(node_id, actor, token, now, up=actor.info.remote())

    def collect(self) -> None:
        """Those that came up are ready; one that failed to start, took too long, or whose process
        died while it waited is ended, and its node warmed again after a wait that doubles."""
        import ray

        now = time.monotonic()
        for warm in list(self.by_node.values()):
            if warm.up is not None and now - warm.started > START_WITHIN:
                self._failed(warm, f"not up within {START_WITHIN:g} s")
        pending = {w.up if w.up is not None else w.watch: w for w in self.by_node.values()}
        if not pending:
            return
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in done:
            warm = pending[ref]
            try:
                result = ray.get(ref)
            except Exception as exc:
                self._failed(warm, f"{type(exc).__name__}: {exc}"[:300])
                continue
            if warm.up is not None:  # it came up
                warm.gpu_ids, warm.up = [str(g) for g in result["gpu_ids"]], None
                warm.watch = warm.actor.until_claimed.remote()
                self._retry.pop(warm.node_id, None)
            else:  # its server stopped while nobody held it
                self._failed(warm, str(result))

    def _failed(self, warm: WarmSession, why: str) -> None:
        wait = self._retry.get(warm.node_id, (0.0, RETRY_FIRST))[1]
        log.warning("a warm session on node %s failed (%s); warming it again in %g s", warm.node_id[:12], why, wait)
        self._retry[warm.node_id] = (time.monotonic() + wait, min(2 * wait, RETRY_MOST))
        self.end(warm.node_id)

    def take(self, nodes: Iterable[str]) -> WarmSession | None:
        """One on one of `nodes`, ready ones first: it is the caller's now. One still starting
        answers its claim as soon as it is up, sooner than a new actor would."""
        mine = [self.by_node[n] for n in nodes if n in self.by_node] if self.enabled else []
        if not mine:
            return None
        warm = min(mine, key=lambda w: not w.ready)
        return self.by_node.pop(warm.node_id)

    def make_room(self, nodes: list[str], free: dict[str, int], gpus: int) -> None:
        """A session that no warm one fits is about to be asked of Ray. If no node of `nodes` has
        `gpus` free beside its warm session, the one on the node with most free ends, so that Ray
        can give its GPU."""
        if any(free[n] - (n in self.by_node) >= gpus for n in nodes):
            return
        held = [n for n in nodes if n in self.by_node]
        if held:
            self.end(max(held, key=lambda n: free[n]))

    def end(self, node_id: str) -> None:
        """End the one on `node_id`, if any."""
        warm = self.by_node.pop(node_id, None)
        if warm is not None:
            end_actor(warm.actor)

    def end_all(self) -> None:
        """End every one: each holds a GPU, and must not outlive the endpoint that made it."""
        for node_id in list(self.by_node):
            self.end(node_id)

    def ready_gpus(self) -> dict[str, list[str]]:
        """Node id -> the GPU its ready warm session holds (shown free, and warm)."""
        return {nid: w.gpu_ids for nid, w in list(self.by_node.items()) if w.ready}
