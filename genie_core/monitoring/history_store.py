"""Metric history and events in an embedded SQLite database (WAL), so they survive a server
restart. Bounded: the oldest rows go once `max_rows` is passed."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

from ..events import ClusterEvent


class HistoryStore:
    def __init__(self, path: str | Path, max_rows: int = 500_000, max_events: int = 10_000) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_rows = max_rows
        self.max_events = max_events
        self._lock = threading.Lock()
        self._writes = 0
        self.conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS metrics (t REAL NOT NULL, key TEXT NOT NULL, value REAL NOT NULL)"
        )
        self.conn.execute("CREATE INDEX IF NOT EXISTS metrics_key_t ON metrics (key, t)")
        self.conn.execute("CREATE TABLE IF NOT EXISTS events (t REAL NOT NULL, event TEXT NOT NULL)")

    def add_metrics(self, t: float, values: dict[str, float]) -> None:
        rows = [(t, k, float(v)) for k, v in values.items() if v is not None]
        with self._lock:
            self.conn.execute("BEGIN")
            self.conn.executemany("INSERT INTO metrics VALUES (?, ?, ?)", rows)
            self.conn.execute("COMMIT")
            self._writes += 1
            if self._writes % 100 == 0:
                self._prune()

    def add_event(self, event: ClusterEvent) -> None:
        with self._lock:
            self.conn.execute(
                "INSERT INTO events VALUES (?, ?)", (event.time, json.dumps(event.to_dict(), default=str))
            )

    def _prune(self) -> None:
        self.conn.execute("DELETE FROM metrics WHERE rowid <= (SELECT MAX(rowid) FROM metrics) - ?", (self.max_rows,))
        self.conn.execute("DELETE FROM events WHERE rowid <= (SELECT MAX(rowid) FROM events) - ?", (self.max_events,))

    def metrics(self, limit_per_key: int = 600) -> dict[str, list[tuple[float, float]]]:
        """The newest `limit_per_key` points of each metric, oldest first."""
        with self._lock:
            keys = [k for (k,) in self.conn.execute("SELECT DISTINCT key FROM metrics")]
            out = {}
            for key in keys:
                rows = self.conn.execute(
                    "SELECT t, value FROM metrics WHERE key = ? ORDER BY t DESC LIMIT ?", (key, limit_per_key)
                ).fetchall()
                out[key] = rows[::-1]
        return out

    def events(self, limit: int = 1000) -> list[ClusterEvent]:
        with self._lock:
            rows = self.conn.execute("SELECT event FROM events ORDER BY rowid DESC LIMIT ?", (limit,)).fetchall()
        return [ClusterEvent.from_dict(json.loads(r)) for (r,) in rows[::-1]]

    def count(self) -> tuple[int, int]:
        with self._lock:
            return (
                self.conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0],
                self.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0],
            )

    def close(self) -> None:
        with self._lock:
            self.conn.close()
