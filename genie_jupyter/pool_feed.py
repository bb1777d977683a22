"""Feeds the pool dashboard from the pool endpoint's own readings: one request a second on one
connection (however many nodes), whatever the kernel is doing. Others' sessions show as "another
user"; your own by name. History is kept here and sent, as float32 bytes, only for the nodes the
user has opened."""

from __future__ import annotations

import json
import math
import struct
import threading
import time
from collections import deque
from typing import Any

INTERVAL = 1.0  # seconds between readings of the pool: its nodes report once a second
HISTORY = 120  # points of history per GPU metric: two minutes


def _percent(value: Any, whole: Any) -> float | None:
    return None if value is None or not whole else round(100.0 * value / whole, 1)


def pool_view(report: dict[str, Any], address: str) -> dict[str, Any]:
    """What the dashboard shows of a pool status report (`PoolClient.status`): per node its health
    and GPUs, each GPU's reading and who holds it (you, by session name; anyone else, "another
    user"), the queue with your place in it, and your sessions' GPUs."""
    nodes, mine = [], []
    for node in report.get("nodes", []):
        holders: dict[str, str] = {}
        for s in node.get("sessions", []):
            own = "session" in s  # the endpoint names only the viewer's own sessions
            label = f"you: {s.get('name') or s['session'][:8]}" if own else "another user"
            for gpu in s.get("gpu_ids", []):
                holders[str(gpu)] = label
        warm = {str(g) for g in node.get("warm", [])}
        readings = {str(g.get("index")): g for g in node.get("gpu_readings") or []}
        gpus = []
        for key in sorted(set(readings) | set(holders) | {str(i) for i in range(node.get("gpus", 0))}, key=int):
            g = readings.get(key, {})
            holder = holders.get(key) or ("free, warm" if key in warm else "free")
            gpus.append(
                {
                    "index": int(key),
                    "name": g.get("name") or "",
                    "utilization": g.get("utilization"),
                    "memory_used": g.get("memory_used"),
                    "memory_total": g.get("memory_total"),
                    "temperature": g.get("temperature"),
                    "power_draw": g.get("power_draw"),
                    "power_limit": g.get("power_limit"),
                    "holder": holder,
                }
            )
            if holder.startswith("you: "):
                mine.append(
                    {
                        "node": node["name"],
                        "gpu": int(key),
                        "session": holder.removeprefix("you: "),
                        "utilization": g.get("utilization"),
                        "memory": _percent(g.get("memory_used"), g.get("memory_total")),
                    }
                )
        health = node.get("health") or {}
        nodes.append(
            {
                "id": node["id"],
                "name": node["name"],
                "ip": node.get("ip", ""),
                "alive": bool(node.get("alive")),
                "simulated": bool(node.get("simulated")),
                "grade": ("DEAD" if not node.get("alive") else health.get("grade") or "NO READING")
                if node.get("gpus")
                else "NO GPUS",
                "reasons": list(health.get("reasons") or []),
                "type": next((g["name"] for g in gpus if g["name"]), ""),
                "free": sum(1 for g in gpus if g["holder"].startswith("free")),
                "gpu_count": len(gpus),
                "utilization": _mean([g["utilization"] for g in gpus]),
                "gpus": gpus,
            }
        )
    queue = report.get("queue", [])
    shown = [n for n in nodes if n["alive"]]
    return {
        "address": address,
        "free": sum(n["free"] for n in shown),  # as the rows below count them
        "total": sum(n["gpu_count"] for n in shown),
        "nodes": nodes,
        "queue": {"length": len(queue), "yours": [i + 1 for i, a in enumerate(queue) if "session" in a]},
        "mine": mine,
    }


class PoolFeed:
    """Reads the pool once a second on a thread of its own and updates the widgets showing it; a
    pool that stops answering greys them out ("lost"), and they come back when it answers."""

    def __init__(self, ask_status: Any, address: str, interval: float = INTERVAL, on_stop: Any = None) -> None:
        self.ask_status = ask_status  # () -> the pool's status report; raises when it does not answer
        self.on_stop = on_stop  # called on the feed's thread once it stops (closes what it asked through)
        self.address = address
        self.interval = interval
        self.widgets: list[Any] = []
        self._history: dict[tuple[str, int], deque[Any]] = {}
        self._times: deque[float] = deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._view: dict[str, Any] | None = None
        self.updates = 0
        self.bytes_sent = 0  # of the pool view and history handed to the front end (for the benchmark)
        self.busy_seconds = 0.0  # spent here (asking excluded) turning readings into widget state
        self.last_seen = 0.0

    def attach(self, widget: Any) -> Any:
        with self._lock:
            self.widgets.append(widget)
            first = len(self.widgets) == 1
        widget.observe(lambda change: self._closed(widget) if change["new"] is None else None, names="comm")
        widget.observe(lambda change: self._send_history([widget]), names="expanded")
        if first:
            threading.Thread(target=self._run, name="genie-pool-feed", daemon=True).start()
        elif self._view is not None:
            self._apply([widget], self._view, "live")
        return widget

    def _closed(self, widget: Any) -> None:
        with self._lock:
            if widget in self.widgets:
                self.widgets.remove(widget)
            if not self.widgets:
                self._stopped.set()

    @property
    def stopped(self) -> bool:
        """It stopped (its last widget closed, or its connection went): a new one is made."""
        return self._stopped.is_set()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            began = time.monotonic()
            self.poll()
            self._stopped.wait(max(0.0, self.interval - (time.monotonic() - began)))
        if self.on_stop is not None:
            self.on_stop()

    def poll(self) -> None:
        """One reading of the pool, handed to the widgets (or, when the pool does not answer, "lost")."""
        try:
            report = self.ask_status()
        except Exception:
            with self._lock:
                widgets = list(self.widgets)
            for w in widgets:
                w.status = "lost"
            return
        began = time.perf_counter()
        view = pool_view(report, self.address)
        self.last_seen = time.time()
        self._times.append(self.last_seen)
        for node in view["nodes"]:
            for g in node["gpus"]:
                points = self._history.setdefault((node["id"], g["index"]), deque(maxlen=HISTORY))
                memory = _percent(g["memory_used"], g["memory_total"])
                points.append((_nan(g["utilization"]), _nan(memory)))
        self._view = view
        with self._lock:
            widgets = list(self.widgets)
        self._apply(widgets, view, "live")
        self.busy_seconds += time.perf_counter() - began

    def _apply(self, widgets: list[Any], view: dict[str, Any], status: str) -> None:
        for w in widgets:
            shown = for_widget(view, list(w.expanded))
            with w.hold_sync():
                w.pool = shown
                w.status = status
                w.last_seen = self.last_seen
                self._history_into(w)
            self.bytes_sent += len(json.dumps(shown)) + len(w.pool_history)
        self.updates += 1

    def _send_history(self, widgets: list[Any]) -> None:
        """A node opened or closed: its GPUs and their history, now (not at the next reading)."""
        for w in widgets:
            with w.hold_sync():
                if self._view is not None:
                    w.pool = for_widget(self._view, list(w.expanded))
                self._history_into(w)

    def _history_into(self, widget: Any) -> None:
        """The history of the GPUs of the nodes the user opened: float32 [rows, 2, points]."""
        opened = list(widget.expanded)
        rows = sorted((k for k in self._history if k[0] in opened), key=lambda k: (opened.index(k[0]), k[1]))
        points = len(self._times)
        data = bytearray()
        for key in rows:
            series = list(self._history[key])
            series = [(math.nan, math.nan)] * (points - len(series)) + series[-points:] if points else []
            data += struct.pack(f"<{points}f", *[u for u, _ in series])
            data += struct.pack(f"<{points}f", *[m for _, m in series])
        widget.pool_history_rows = [[n, i] for n, i in rows]
        widget.pool_history_shape = [len(rows), 2, points]
        widget.pool_history_span = (self._times[-1] - self._times[0]) if points > 1 else 0.0
        widget.pool_history = bytes(data)


def _mean(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 1) if known else None


def for_widget(view: dict[str, Any], opened: list[str]) -> dict[str, Any]:
    """What goes to one front end: every node's line, and GPUs only for the nodes it has opened
    (a closed node is drawn as one line: the GPUs of a hundred nodes need not travel)."""
    keep = set(opened)
    nodes = [n if n["id"] in keep else {**n, "gpus": []} for n in view["nodes"]]
    return {**view, "nodes": nodes}


def _nan(value: Any) -> float:
    return math.nan if value is None else float(value)
