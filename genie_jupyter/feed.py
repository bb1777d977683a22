"""Feeds widgets from the client's EventBus on a background thread, so gauges move while the
kernel is idle and while a `%%remote` cell runs. Updates are throttled; a widget that is closed
is dropped, and with none left the feed unsubscribes."""

from __future__ import annotations

import math
import struct
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from genie_core import ClusterEvent, EventType

MAX_RATE = 4.0  # widget updates per second, at most
HISTORY = 300  # points of history per metric: five minutes at the default one reading a second
METRICS = ("utilization", "memory", "temperature", "power")
MAX_EVENTS = 200


def _percent(value: Any, whole: Any) -> float:
    return float("nan") if value is None or not whole else 100.0 * value / whole


class ClusterFeed:
    def __init__(self, state: Any) -> None:
        self.state = state
        self.widgets: list[Any] = []
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._history: dict[int, deque[Any]] = {}
        self._times: deque[float] = deque(maxlen=HISTORY)  # when each reading was taken
        self._events: deque[Mapping[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._values: dict[str, Any] = {"status": "live"}
        self._unsubscribe = None
        self._stopped = threading.Event()
        self.updates = 0  # flushes done, for tests and curiosity
        report = getattr(state, "backend_report", None)
        if report is not None:
            self._values["backend"] = report.to_dict()
        for event in state.events.history():
            self._on_event(event, initial=True)
        if state.metrics is not None:
            self._take_metrics(state.metrics.to_dict(), state.health.to_dict() if state.health else None)

    def attach(self, widget: Any) -> Any:
        with self._lock:
            self.widgets.append(widget)
            start = self._unsubscribe is None
        widget.observe(lambda change: self._closed(widget) if change["new"] is None else None, names="comm")
        self._apply(widget, dict(self._values))
        if start:
            self._unsubscribe = self.state.events.subscribe(self._on_event)
            threading.Thread(target=self._flusher, name="genie-widgets", daemon=True).start()
        return widget

    def _closed(self, widget: Any) -> None:
        with self._lock:
            if widget in self.widgets:
                self.widgets.remove(widget)
            empty = not self.widgets
        if empty:
            self.stop()

    @property
    def stopped(self) -> bool:
        """It stopped (its last widget closed, or its connection went): a new one is made."""
        return self._stopped.is_set()

    def stop(self) -> None:
        self._stopped.set()
        self._dirty.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    # -- from the EventBus (any thread) ---------------------------------------------------
    def _on_event(self, event: ClusterEvent, initial: bool = False) -> None:
        if event.type is EventType.METRICS:
            self._take_metrics(event.data.get("node") or {}, event.data.get("health"))
        else:
            with self._lock:
                self._events.appendleft(event.to_dict())
                self._values["events"] = list(self._events)
                if event.type is EventType.NODE_LOST:
                    self._values["status"] = "lost"
                    self._values["last_seen"] = float(event.data.get("last_seen") or event.time)
                elif event.type is EventType.NODE_RECOVERED:
                    self._values["status"] = "live"
                elif event.type is EventType.BACKEND_SELECTED and event.data.get("report"):
                    self._values["backend"] = event.data["report"]
        if not initial:
            self._dirty.set()

    def _take_metrics(self, node: dict[str, Any], health: dict[str, Any] | None) -> None:
        gpus = node.get("gpus") or []
        with self._lock:
            for g in gpus:
                row = (
                    g.get("utilization"),
                    _percent(g.get("memory_used"), g.get("memory_total")),
                    _percent(g.get("temperature"), g.get("temperature_slowdown") or 90.0),
                    _percent(g.get("power_draw"), g.get("power_limit")),
                )
                self._history.setdefault(g["index"], deque(maxlen=HISTORY)).append(
                    [float("nan") if v is None else float(v) for v in row]
                )
            self._times.append(float(node.get("time") or time.time()))
            if len(self._times) > 1:  # the chart's whole width: HISTORY readings at the interval seen so far
                interval = (self._times[-1] - self._times[0]) / (len(self._times) - 1)
                self._values["history_span"] = interval * (HISTORY - 1)
            self._values["gpus"] = gpus
            self._values["cpu_only_reason"] = node.get("gpu_reason") or ""
            self._values["history"], self._values["history_shape"] = self._pack([g["index"] for g in gpus])
            if health:
                client_health = self.state.health
                self._values["health"] = client_health.to_dict() if client_health else health

    def _pack(self, indices: list[int]) -> tuple[bytes, list[int]]:
        out = bytearray()
        for i in indices:
            points = list(self._history.get(i, ()))
            points = [[math.nan] * len(METRICS)] * (HISTORY - len(points)) + points
            for m in range(len(METRICS)):
                out += struct.pack(f"<{HISTORY}f", *(p[m] for p in points))
        return bytes(out), [len(indices), len(METRICS), HISTORY]

    # -- to the widgets (one thread, at most MAX_RATE times a second) ----------------------------
    def _flusher(self) -> None:
        while not self._stopped.is_set():
            self._dirty.wait()
            if self._stopped.is_set():
                return
            self._dirty.clear()
            with self._lock:
                values = dict(self._values)
                widgets = list(self.widgets)
            for w in widgets:
                self._apply(w, values)
            self.updates += 1
            time.sleep(1.0 / MAX_RATE)

    @staticmethod
    def _apply(widget: Any, values: dict[str, Any]) -> None:
        with widget.hold_sync():
            for name, value in values.items():
                if getattr(widget, name) != value:
                    setattr(widget, name, value)
