"""The pool's registry: users (their stored keys and quotas), sessions, and an audit log of events.

SQLite by default (a file beside the pool's state), PostgreSQL with `postgresql://...`; one schema
and one set of statements for both. Membership is not here: which nodes are alive is Ray's to say.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS users (
        name TEXT PRIMARY KEY,
        stored_key TEXT NOT NULL,
        max_gpus INTEGER,
        max_sessions INTEGER,
        gpu_hours_per_day DOUBLE PRECISION,
        created DOUBLE PRECISION NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS sessions (
        id TEXT PRIMARY KEY,
        user_name TEXT NOT NULL,
        name TEXT NOT NULL,
        gpus INTEGER NOT NULL,
        node_id TEXT,
        host TEXT,
        gpu_ids TEXT,
        state TEXT NOT NULL,
        asked DOUBLE PRECISION NOT NULL,
        placed DOUBLE PRECISION,
        ended DOUBLE PRECISION,
        end_reason TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS events (
        ts DOUBLE PRECISION NOT NULL,
        kind TEXT NOT NULL,
        user_name TEXT,
        session_id TEXT,
        detail TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS readings (
        ts DOUBLE PRECISION NOT NULL,
        node_id TEXT NOT NULL,
        gpu INTEGER NOT NULL,
        utilization DOUBLE PRECISION,
        memory_used DOUBLE PRECISION,
        temperature DOUBLE PRECISION
    )""",
    "CREATE INDEX IF NOT EXISTS events_by_time ON events (ts)",
    "CREATE INDEX IF NOT EXISTS readings_by_node ON readings (node_id, ts)",
    "CREATE INDEX IF NOT EXISTS sessions_by_user ON sessions (user_name, state)",
)

log = logging.getLogger("genie.pool")


@dataclass(frozen=True)
class User:
    name: str
    stored_key: str
    max_gpus: int | None  # GPUs at once
    max_sessions: int | None  # live sessions at once
    gpu_hours_per_day: float | None  # over the last 24 hours


class Registry:
    """One connection, used under a lock (the pool endpoint's thread, and tests and tools reading it)."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or ""
        self._lock = threading.Lock()
        if self.url.startswith(("postgresql://", "postgres://")):
            try:
                import psycopg
            except ImportError:
                raise ConfigError("a PostgreSQL registry needs psycopg: pip install 'genie-jupyter[pool]'") from None
            try:
                self._db: Any = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
            except psycopg.Error as exc:
                raise ConfigError(f"cannot open the registry at {_redacted(self.url)}: {exc}".strip()) from None
            self._placeholder = "%s"
        else:
            path = self.url.removeprefix("sqlite:///") or ":memory:"
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._placeholder = "?"
        for statement in SCHEMA:
            self._run(statement)

    @property
    def kind(self) -> str:
        return "postgresql" if self._placeholder == "%s" else "sqlite"

    def _run(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                cursor = self._db.execute(sql.replace("?", self._placeholder), params)
            except Exception as exc:
                if self.kind != "postgresql" or not (self._db.closed or getattr(self._db, "broken", False)):
                    raise
                # The server restarted or the connection dropped: open a new one, once, and go on
                import psycopg

                log.warning("the registry's connection to PostgreSQL was lost (%s); reconnecting", exc)
                self._db = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
                cursor = self._db.execute(sql.replace("?", self._placeholder), params)
            return list(cursor.fetchall()) if cursor.description else []

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- users ---------------------------------------------------------------------------
    def add_user(
        self,
        name: str,
        stored_key: str,
        max_gpus: int | None = None,
        max_sessions: int | None = None,
        gpu_hours_per_day: float | None = None,
    ) -> None:
        if self.user(name) is not None:
            raise ConfigError(f"user {name!r} exists: `genie pool user token {name}` gives them a new token")
        self._run(
            "INSERT INTO users VALUES (?, ?, ?, ?, ?, ?)",
            (name, stored_key, max_gpus, max_sessions, gpu_hours_per_day, time.time()),
        )
        self.event("user_added", name, None, {})

    def set_key(self, name: str, stored_key: str) -> None:
        self._run("UPDATE users SET stored_key = ? WHERE name = ?", (stored_key, name))

    def user(self, name: str) -> User | None:
        rows = self._run(
            "SELECT name, stored_key, max_gpus, max_sessions, gpu_hours_per_day FROM users WHERE name = ?", (name,)
        )
        return User(*rows[0]) if rows else None

    # -- sessions ------------------------------------------------------------------------
    def session_asked(self, session_id: str, user: str, name: str, gpus: int) -> None:
        self._run(
            "INSERT INTO sessions (id, user_name, name, gpus, state, asked) VALUES (?, ?, ?, ?, 'queued', ?)",
            (session_id, user, name, gpus, time.time()),
        )

    def session_placed(self, session_id: str, node_id: str, host: str, gpu_ids: list[str]) -> None:
        self._run(
            "UPDATE sessions SET state = 'placed', node_id = ?, host = ?, gpu_ids = ?, placed = ? WHERE id = ?",
            (node_id, host, ",".join(gpu_ids), time.time(), session_id),
        )

    def session_ended(self, session_id: str, reason: str) -> None:
        self._run(
            "UPDATE sessions SET state = 'ended', ended = ?, end_reason = ? WHERE id = ? AND state <> 'ended'",
            (time.time(), reason, session_id),
        )

    def sessions(self, user: str | None = None, live_only: bool = True) -> list[dict[str, Any]]:
        sql = (
            "SELECT id, user_name, name, gpus, node_id, host, gpu_ids, state, asked, placed, ended, end_reason "
            "FROM sessions WHERE 1 = 1"
        )
        params: tuple[Any, ...] = ()
        if user is not None:
            sql, params = sql + " AND user_name = ?", (user,)
        if live_only:
            sql += " AND state IN ('queued', 'placed')"
        keys = ("id", "user", "name", "gpus", "node_id", "host", "gpu_ids", "state", "asked", "placed", "ended")
        return [
            {**dict(zip(keys, row, strict=False)), "end_reason": row[11]}
            for row in self._run(sql + " ORDER BY asked", params)
        ]

    def gpu_hours(self, user: str, since: float) -> float:
        """GPU-hours a user's sessions held since `since` (live ones count up to now)."""
        now = time.time()
        rows = self._run(
            "SELECT gpus, placed, ended FROM sessions WHERE user_name = ? AND placed IS NOT NULL "
            "AND (ended IS NULL OR ended > ?)",
            (user, since),
        )
        return float(sum(gpus * (min(ended or now, now) - max(placed, since)) for gpus, placed, ended in rows) / 3600)

    # -- events: the audit log -----------------------------------------------------------
    def event(
        self, kind: str, user: str | None, session_id: str | None, detail: dict[str, Any], at: float | None = None
    ) -> None:
        self._run(
            "INSERT INTO events VALUES (?, ?, ?, ?, ?)",
            (at or time.time(), kind, user, session_id, json.dumps(detail, sort_keys=True)),
        )

    def events(self, limit: int = 100, user: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT ts, kind, user_name, session_id, detail FROM events"
        params: tuple[Any, ...] = ()
        if user is not None:
            sql, params = sql + " WHERE user_name = ?", (user,)
        rows = self._run(sql + " ORDER BY ts DESC LIMIT ?", (*params, limit))
        return [
            {"time": ts, "kind": kind, "user": u, "session": s, **json.loads(detail)}
            for ts, kind, u, s, detail in reversed(rows)
        ]

    # -- metric history --------------------------------------------------------------------
    def add_readings(self, rows: list[tuple[float, str, int, float | None, float | None, float | None]]) -> None:
        """(time, node, GPU, utilization %, memory used bytes, temperature) rows, in one transaction."""
        if not rows:
            return
        with self._lock:
            sql = "INSERT INTO readings VALUES (?, ?, ?, ?, ?, ?)".replace("?", self._placeholder)
            if self.kind == "sqlite":
                self._db.execute("BEGIN")
                try:
                    self._db.executemany(sql, rows)
                finally:
                    self._db.execute("COMMIT")
            else:
                with self._db.cursor() as cursor:
                    cursor.executemany(sql, rows)

    def readings(self, node_id: str, since: float) -> list[tuple[float, int, float | None, float | None, float | None]]:
        return [
            tuple(row)
            for row in self._run(
                "SELECT ts, gpu, utilization, memory_used, temperature FROM readings "
                "WHERE node_id = ? AND ts >= ? ORDER BY ts, gpu",
                (node_id, since),
            )
        ]

    def forget_readings(self, before: float) -> None:
        self._run("DELETE FROM readings WHERE ts < ?", (before,))


def _redacted(url: str) -> str:
    """A database URL without its password, for error messages."""
    head, at, tail = url.rpartition("@")
    if not at:
        return url
    scheme, _, credentials = head.partition("://")
    return f"{scheme}://{credentials.split(':')[0]}:***@{tail}"
