"""Sessions' upkeep on the server: a silent client's lease runs out (an unnamed session ends, a
named one is detached and waits), an idle detached session is culled after a warning, a session
is closed (its workers and directory go), and which processes are whose (for `%genie_status`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import psutil

from ..config import ClusterConfig
from ..events import ClusterEvent, EventBus, EventType, Severity
from .sessions import Session, SessionTable
from .workers import WorkerPool

log = logging.getLogger("genie.server")


class Upkeep:
    def __init__(
        self, *, config: ClusterConfig, node_id: str, sessions: SessionTable, workers: WorkerPool, bus: EventBus
    ) -> None:
        self.config, self.node_id, self.sessions, self.workers, self.bus = config, node_id, sessions, workers, bus

    def tick(self) -> None:
        """Every 0.2 s on the loop thread: workers' own upkeep, leases, idle sessions."""
        self.workers.housekeeping()
        lease = self.config.session_lease
        expired = self.sessions.expired(lease)
        for session in expired:
            if not session.name:
                self.close(session, f"no message from the client for {lease:.0f} s")
            elif not session.detached:  # a named session waits for a client to attach
                session.detached = True
                self.event(
                    session,
                    EventType.SESSION_DETACHED,
                    Severity.WARNING,
                    f"session {session.name!r} has had no client for {lease:.0f} s; it keeps running "
                    "until a client attaches (%genie_init ADDR --session NAME)"
                    + (f" or it has been idle {self.config.idle_timeout:.0f} s" if self.config.idle_timeout else ""),
                )
        for session in self.sessions.live.values():
            if session.detached and session not in expired:
                session.detached = False  # its client spoke again (a partition healed)
        if self.config.idle_timeout > 0:
            self._cull_idle(self.config.idle_timeout)

    def _cull_idle(self, limit: float) -> None:
        """End sessions with no client and nothing running for `limit` seconds, after a warning
        event at 80% of it. A session with a running cell or job is never idle."""
        lease, now = self.config.session_lease, time.monotonic()
        for session in list(self.sessions.live.values()):
            busy = any(w.inflight for w in self.workers.of(session).values())
            if busy or session.jobs.running() or not session.detached:
                session.quiet_since, session.idle_warned = now, False
                continue
            idle = now - max(session.quiet_since, session.last_seen + lease)  # no client, nothing running
            if idle >= limit:
                self.close(session, f"idle: no client and nothing running for {limit:.0f} s")
            elif idle >= 0.8 * limit and not session.idle_warned:
                session.idle_warned = True
                self.event(
                    session,
                    EventType.SESSION_IDLE,
                    Severity.WARNING,
                    f"session {session.name or session.id[:8]!r} has been idle {idle:.0f} s: it ends in "
                    f"{limit - idle:.0f} s unless a client attaches",
                )

    def close(self, session: Session, why: str) -> None:
        """The session ends: its record is kept a while (outcomes), its workers and directory go."""
        log.info("session %s closed: %s", session.id[:8], why)
        self.sessions.end(session, why)
        if session.client.get("purpose") != "probe":
            self.bus.emit(
                ClusterEvent(
                    EventType.SESSION_CLOSED,
                    self.node_id,
                    Severity.INFO,
                    {
                        "session": session.id[:8],
                        "client": session.client,
                        "message": f"session {session.id[:8]} closed: {why}",
                    },
                )
            )
        self.workers.release(session)
        if session.directory is not None:
            session.directory.remove()

    def event(self, session: Session, kind: EventType, severity: Severity, message: str) -> None:
        self.bus.emit(
            ClusterEvent(
                kind, self.node_id, severity, {"session": session.id[:8], "name": session.name, "message": message}
            )
        )

    def process_owners(self) -> dict[int, dict[str, Any]]:
        """pid -> the session whose worker it is, or whose worker started it (any thread: it reads
        snapshots of the session and worker tables)."""
        owners: dict[int, dict[str, Any]] = {}
        for session in list(self.sessions.live.values()):
            label = {
                "session": session.id[:8],
                "name": session.name,
                "user": session.client.get("user", ""),
                "host": session.client.get("host", ""),
            }
            owners.update((worker.pid, label) for worker in list(self.workers.of(session).values()))
        if not owners:
            return owners
        children: dict[int, list[int]] = {}  # one pass over the process table, not one per worker
        for proc in psutil.process_iter(["ppid"]):
            children.setdefault(proc.info["ppid"] or 0, []).append(proc.pid)
        todo = list(owners)
        while todo:
            parent = todo.pop()
            for child in children.get(parent, []):
                if child not in owners:
                    owners[child] = owners[parent]
                    todo.append(child)
        return owners
