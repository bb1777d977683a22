"""The pool's front-door protocol (genie_core/protocol/pool.py): proofs, replies, sealing, replays."""

from __future__ import annotations

import time

import pytest

from genie_core.protocol import pool as wire

TOKEN = "alice:correct-horse-battery-staple"


def test_a_request_proves_its_token_without_carrying_it():
    request, key = wire.sign_request("alice", TOKEN, "place", gpus=1)
    assert TOKEN.split(":")[1] not in str(request)
    assert wire.verify_request(request, wire.stored_key(TOKEN)) == key == wire.client_key(TOKEN)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda r: r["args"].update(gpus=8),  # more GPUs than asked
        lambda r: r.update(user="bob"),  # someone else's name
        lambda r: r.update(op="end"),
        lambda r: r.update(ts=r["ts"] + 1),
        lambda r: r.update(proof="00" * 32),
        lambda r: r.pop("proof"),
    ],
    ids=["args", "user", "op", "timestamp", "proof", "no proof"],
)
def test_a_tampered_request_fails_its_proof(tamper):
    request, _ = wire.sign_request("alice", TOKEN, "place", gpus=1)
    tamper(request)
    assert wire.verify_request(request, wire.stored_key(TOKEN)) is None


def test_another_token_fails_the_proof():
    request, _ = wire.sign_request("alice", "alice:guess", "status")
    assert wire.verify_request(request, wire.stored_key(TOKEN)) is None


def test_replies_are_checked_with_the_users_key():
    key = wire.client_key(TOKEN)
    reply = wire.sign_reply({"re": "r1", "kind": "placed", "port": 5000}, key)
    assert wire.reply_is_genuine(reply, key)
    assert not wire.reply_is_genuine({**reply, "port": 6000}, key)  # redirected elsewhere
    assert not wire.reply_is_genuine(reply, wire.client_key("bob:other"))


def test_a_sealed_session_token_opens_only_with_the_users_key_and_request():
    key = wire.client_key(TOKEN)
    secret = "f" * 48
    sealed = wire.seal(secret, key, "r1")
    assert secret not in sealed
    assert wire.unseal(sealed, key, "r1") == secret
    for wrong_key, request_id in ((wire.client_key("bob:other"), "r1"), (key, "r2")):
        try:
            opened = wire.unseal(sealed, wrong_key, request_id)
        except UnicodeDecodeError:  # noise, not text
            continue
        assert opened != secret


def test_replays_and_stale_requests_are_refused():
    replays = wire.Replays(window=300)
    request, _ = wire.sign_request("alice", TOKEN, "place", gpus=1)
    assert replays.fresh(request) == ""
    assert replays.fresh(request) == "a replayed request"
    old = {**request, "id": "x", "ts": time.time() - 3600}
    assert "3600 s old" in replays.fresh(old)
    assert replays.fresh({"ts": "soon"}) == "a request without an id or timestamp"


def test_replay_memory_is_bounded_by_its_window():
    replays = wire.Replays(window=0.2)
    for i in range(1000):
        assert replays.fresh({"id": f"r{i}", "ts": time.time()}) == ""
    time.sleep(0.3)
    replays.fresh({"id": "last", "ts": time.time()})
    assert len(replays._seen) == 1 and len(replays._order) == 1
