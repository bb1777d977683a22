"""Typed cluster events and the bus that carries them to subscribers (widgets, CLI, user code)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .protocol.contents import Event

log = logging.getLogger("genie.events")


class EventType(str, enum.Enum):
    CONNECTED = "CONNECTED"
    BACKEND_SELECTED = "BACKEND_SELECTED"
    NODE_LOST = "NODE_LOST"
    NODE_RECOVERED = "NODE_RECOVERED"
    NODE_DEGRADED = "NODE_DEGRADED"
    HEALTH_CHANGED = "HEALTH_CHANGED"
    SESSION_CLOSED = "SESSION_CLOSED"
    SESSION_DETACHED = "SESSION_DETACHED"  # a named session's client went silent: the session waits for one
    SESSION_ATTACHED = "SESSION_ATTACHED"  # a client attached to a named session
    SESSION_IDLE = "SESSION_IDLE"  # a session will be ended for idleness (--idle-timeout) unless used
    REQUEST_OUTCOME = "REQUEST_OUTCOME"  # what became of a request cut off by a lost connection
    GPU_AVAILABLE = "GPU_AVAILABLE"
    GPU_UNAVAILABLE = "GPU_UNAVAILABLE"
    GPU_OVERHEATED = "GPU_OVERHEATED"
    GPU_POWER_LIMIT = "GPU_POWER_LIMIT"
    MEMORY_PRESSURE = "MEMORY_PRESSURE"
    METRICS = "METRICS"  # a periodic snapshot of a node's readings; not kept in history


EPHEMERAL = frozenset({EventType.METRICS})


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


@dataclass(frozen=True)
class ClusterEvent:
    type: EventType
    node: str
    severity: Severity = Severity.INFO
    data: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    @property
    def message(self) -> str:
        return str(self.data.get("message", self.type.value))

    def to_dict(self) -> Event:
        """The content of an `event` message."""
        return {
            "type": self.type.value,
            "node": self.node,
            "severity": self.severity.value,
            "data": self.data,
            "time": self.time,
        }

    @classmethod
    def from_dict(cls, d: Event) -> ClusterEvent:
        return cls(
            EventType(d["type"]), d["node"], Severity(d["severity"]), dict(d.get("data") or {}), float(d["time"])
        )


Handler = Callable[[ClusterEvent], Any]


@dataclass
class _Subscription:
    handler: Handler
    types: frozenset[EventType] | None
    loop: asyncio.AbstractEventLoop | None


class EventBus:
    """Publish/subscribe for `ClusterEvent`s. Thread-safe.

    A handler that raises is logged and the others still run. Coroutine handlers run on the
    event loop that was running when they subscribed (or on a private background loop).
    A bounded history lets late subscribers catch up (`replay=True`).
    """

    def __init__(self, history: int = 1000) -> None:
        self._subs: list[_Subscription] = []
        self._history: deque[ClusterEvent] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._bg_loop: asyncio.AbstractEventLoop | None = None

    def subscribe(
        self, handler: Handler, types: Iterable[EventType | str] | None = None, *, replay: bool = False
    ) -> Callable[[], None]:
        """Call `handler(event)` for each event (of `types`, if given). Returns `unsubscribe`."""
        loop = None
        if inspect.iscoroutinefunction(handler):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = self._background_loop()
        sub = _Subscription(handler, frozenset(EventType(t) for t in types) if types is not None else None, loop)
        with self._lock:
            self._subs.append(sub)
            past = list(self._history) if replay else []
        for event in past:
            if sub.types is None or event.type in sub.types:
                self._deliver(sub, event)
        return lambda: self.unsubscribe(handler)

    def unsubscribe(self, handler: Handler) -> None:
        with self._lock:
            self._subs = [s for s in self._subs if s.handler is not handler]

    def emit(self, event: ClusterEvent) -> None:
        with self._lock:
            if event.type not in EPHEMERAL:
                self._history.append(event)
            subs = list(self._subs)
        for sub in subs:
            if sub.types is None or event.type in sub.types:
                self._deliver(sub, event)

    def preload(self, events: Iterable[ClusterEvent]) -> None:
        """Fill the history (after a restart, from the store) without notifying anyone."""
        with self._lock:
            self._history.extend(events)

    def history(self, types: Iterable[EventType | str] | None = None, limit: int | None = None) -> list[ClusterEvent]:
        wanted = None if types is None else {EventType(t) for t in types}
        with self._lock:
            events = [e for e in self._history if wanted is None or e.type in wanted]
        return events[-limit:] if limit else events

    def _deliver(self, sub: _Subscription, event: ClusterEvent) -> None:
        try:
            if sub.loop is not None:
                future = asyncio.run_coroutine_threadsafe(sub.handler(event), sub.loop)

                def report(f: concurrent.futures.Future[Any]) -> None:
                    exc = f.exception()
                    if exc:
                        log.error("async event handler %r failed: %r", sub.handler, exc)

                future.add_done_callback(report)
            else:
                sub.handler(event)
        except Exception:
            log.exception("event handler %r failed on %s", sub.handler, event.type.value)

    def _background_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._bg_loop is None:
                self._bg_loop = asyncio.new_event_loop()
                threading.Thread(target=self._bg_loop.run_forever, name="genie-events", daemon=True).start()
            return self._bg_loop
