"""The pool's registry on SQLite and on a real PostgreSQL server: one schema, the same answers."""

from __future__ import annotations

import time

import pytest

from genie_core.errors import ConfigError
from genie_core.pool.queue import QuotaExceeded, check_quota
from genie_core.pool.registry import Registry
from genie_core.protocol import pool as wire


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.sqlite'}"
    pg = request.getfixturevalue("postgresql")
    db = Registry(pg.url)  # each test its own tables: drop what an earlier test left
    for table in ("users", "sessions", "events"):
        db._run(f"DROP TABLE IF EXISTS {table}")
    db.close()
    return pg.url


def test_users_sessions_and_events_are_kept_and_read_back(url):
    db = Registry(url)
    db.add_user("alice", wire.stored_key("alice:s3cret"), max_gpus=2, max_sessions=1, gpu_hours_per_day=8)
    with pytest.raises(ConfigError, match="user 'alice' exists"):
        db.add_user("alice", "x")
    user = db.user("alice")
    assert user is not None and user.max_gpus == 2 and user.gpu_hours_per_day == 8
    assert db.user("bob") is None
    db.session_asked("s1", "alice", "work", 2)
    assert [s["state"] for s in db.sessions("alice")] == ["queued"]
    db.session_placed("s1", "node-a", "127.0.0.1", ["0", "1"])
    live = db.sessions("alice")
    assert live[0]["state"] == "placed" and live[0]["gpu_ids"] == "0,1" and live[0]["name"] == "work"
    db.session_ended("s1", "its client ended it")
    assert db.sessions("alice") == []
    assert db.sessions("alice", live_only=False)[0]["end_reason"] == "its client ended it"
    db.event("placed", "alice", "s1", {"node": "node-a"})
    db.event("node_lost", None, None, {"node": "node-b"})
    kinds = [e["kind"] for e in db.events()]
    assert kinds[-2:] == ["placed", "node_lost"] and kinds[0] == "user_added"
    assert [e["kind"] for e in db.events(user="alice")] == ["user_added", "placed"]
    db.close()


def test_gpu_hours_count_only_the_last_day(url):
    db = Registry(url)
    now = time.time()
    for sid, gpus, placed, ended in (("old", 4, now - 3 * 86400, now - 2 * 86400), ("a", 2, now - 7200, now - 3600)):
        db.session_asked(sid, "carol", "", gpus)
        db._run("UPDATE sessions SET placed = ?, ended = ?, state = 'ended' WHERE id = ?", (placed, ended, sid))
    db.session_asked("live", "carol", "", 1)
    db._run("UPDATE sessions SET placed = ?, state = 'placed' WHERE id = ?", (now - 1800, "live"))
    hours = db.gpu_hours("carol", now - 86400)
    assert hours == pytest.approx(2 * 1 + 1 * 0.5, abs=0.01)  # 'old' is outside the day
    db.add_user("carol", "k", gpu_hours_per_day=2.0)
    user = db.user("carol")
    assert user is not None
    with pytest.raises(QuotaExceeded, match=r"may use 2 GPU-hours a day and used 2\.50"):
        check_quota(user, 1, db.sessions("carol"), hours)
    db.close()


def test_postgresql_history_survives_a_restart_of_the_database_server(postgresql):
    db = Registry(postgresql.url)
    for table in ("users", "sessions", "events"):
        db._run(f"DROP TABLE IF EXISTS {table}")
    db.close()
    db = Registry(postgresql.url)
    db.add_user("dave", wire.stored_key("dave:x"))
    db.event("placed", "dave", "s9", {"node": "node-c"})
    kept = Registry(postgresql.url)  # a pool's connection, open while the database restarts
    db.close()
    postgresql.stop()
    postgresql.start()
    assert kept.user("dave") is not None  # it reconnects
    kept.close()
    again = Registry(postgresql.url)
    assert again.kind == "postgresql"
    assert again.user("dave") is not None
    assert [e["kind"] for e in again.events(user="dave")] == ["user_added", "placed"]
    again.close()


def test_an_unreachable_database_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"cannot open the registry at postgresql://genie:\*\*\*@/nowhere"):
        Registry("postgresql://genie:hunter2@/nowhere?host=/nonexistent-socket-dir")


def test_quota_checks_name_the_quota():
    from genie_core.pool.registry import User

    user = User("erin", "k", max_gpus=2, max_sessions=2, gpu_hours_per_day=None)
    check_quota(user, 2, [], 0.0)
    with pytest.raises(QuotaExceeded, match="erin may hold 2 GPU"):
        check_quota(user, 1, [{"gpus": 2}], 0.0)
    with pytest.raises(QuotaExceeded, match="erin may have 2 session"):
        check_quota(user, 0, [{"gpus": 0}, {"gpus": 0}], 0.0)
