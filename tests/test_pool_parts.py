"""The pool endpoint's bookkeeping without Ray: the node table and readings (nodes.py), where an
ask fits (placement.py) and the audit log (audit.py). tests/test_pool.py runs them on a real
Ray cluster; here each rule is checked on its own, in milliseconds."""

from __future__ import annotations

import json
import time

import pytest

from genie_core.pool import placement
from genie_core.pool.audit import Audit
from genie_core.pool.live import LiveSession
from genie_core.pool.monitor_actor import sign
from genie_core.pool.nodes import Nodes
from genie_core.pool.queue import Ask
from genie_core.pool.registry import Registry


def ray_node(node_id: str, ip: str, gpus: int = 2, alive: bool = True, kind: str = "") -> dict:
    """An entry as `ray.nodes()` gives it."""
    resources = {"GPU": float(gpus), **({f"accelerator_type:{kind}": 1.0} if kind else {})}
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": ip,
        "NodeManagerHostname": "h",
        "Resources": resources,
    }


def ask(gpus: int = 1, accelerator: str = "") -> Ask:
    return Ask("s1", "alice", "", gpus, time.time() + 60, b"c", "r1", b"k", accelerator=accelerator)


def test_the_node_table_names_its_machines_addresses_and_who_died():
    """The addresses are what the sandbox blocks cells from reaching (Ray's nodes). A death is
    told once; if its handling fails, the next update tells it again."""
    nodes, died = Nodes(history_every=30.0), []

    def told(node_id: str, node: dict) -> None:
        died.append((node_id, node["gpus"]))

    nodes.update([ray_node("a" * 56, "10.0.0.1"), ray_node("b" * 56, "10.0.0.2", gpus=0)], told)
    assert nodes.addresses() == {"10.0.0.1", "10.0.0.2"} and died == []
    assert [nid for nid, _ in nodes.unwatched()] == ["a" * 56]  # a node without GPUs gets no monitor
    dead = [ray_node("a" * 56, "10.0.0.1", gpus=0, alive=False), ray_node("b" * 56, "10.0.0.2", gpus=0)]

    def fails(node_id: str, node: dict) -> None:
        raise OSError("the registry is away")

    with pytest.raises(OSError):
        nodes.update(dead, fails)
    nodes.update(dead, told)
    assert died == [("a" * 56, 2)]  # told after the failed try; a dead node keeps the GPUs it had
    nodes.update(dead, told)
    assert died == [("a" * 56, 2)]  # told once


def test_a_reading_is_kept_only_signed_and_from_a_known_node_and_sampled_for_history():
    nodes = Nodes(history_every=30.0)
    nodes.update([ray_node("n1", "10.0.0.1")], on_death=lambda node_id, node: None)
    gpu = {"index": 0, "utilization": 50.0, "memory_used": 1, "temperature": 60.0}

    def reading(node: str, at: float) -> bytes:
        return json.dumps({"node_id": node, "time": at, "gpus": [gpu]}).encode()

    assert not nodes.take(reading("n1", 100.0), sign(reading("n1", 100.0), b"another key"))
    assert not nodes.take(reading("n9", 100.0), sign(reading("n9", 100.0), nodes.key))
    assert not nodes.take(b"not json", sign(b"not json", nodes.key))
    for at in (100.0, 110.0, 131.0):
        assert nodes.take(reading("n1", at), sign(reading("n1", at), nodes.key))
    assert nodes.readings["n1"]["time"] == 131.0 and nodes.taken == 3
    assert [row[0] for row in nodes.flush_history()] == [100.0, 131.0]  # one a history_every
    assert nodes.flush_history() == []


def test_free_gpus_count_sessions_not_placed_yet_against_the_roomiest_node():
    table = {"a": {"alive": True, "gpus": 4}, "b": {"alive": True, "gpus": 2}, "c": {"alive": False, "gpus": 8}}
    table["sim"] = {"alive": True, "gpus": 8, "simulated": True}  # reports readings only
    placed = LiveSession("s1", "alice", "", 1, None, node_id="b")
    pending = LiveSession("s2", "bob", "", 3, None)  # Ray has not placed it yet
    assert placement.free_by_node(table, [placed, pending]) == {"a": 1, "b": 1}
    assert placement.free_and_total(table, [placed, pending]) == {"free": 2, "total": 6}


def test_an_ask_fits_nodes_with_room_of_its_gpu_type():
    table = {"a": {"alive": True, "gpus": 4, "accelerators": ["A100"]}, "b": {"alive": True, "gpus": 4}}
    assert placement.fits(ask(2), {"a": 3, "b": 1}, table) == ["a"]
    assert placement.fits(ask(1, "A100"), {"a": 0, "b": 4}, table) == []
    assert placement.fits(ask(1, "A100"), {"a": 1, "b": 4}, table) == ["a"]


@pytest.mark.parametrize(
    ("gpus", "kind", "why"),
    [
        (0, "", "a pool session holds 1 GPU or more (asked 0)"),
        (5, "", "no node of this pool has 5 GPUs (the largest has 4)"),
        (1, "H100", "no node of this pool has H100 GPUs (it has: A100)"),
        (3, "A100", "no node of this pool has 3 GPUs (the largest has 2)"),
        (4, "", None),
    ],
)
def test_an_ask_no_node_could_ever_hold_is_told_why(gpus, kind, why):
    table = {
        "a": {"alive": True, "gpus": 2, "accelerators": ["A100"]},
        "b": {"alive": True, "gpus": 4},
        "c": {"alive": False, "gpus": 8, "accelerators": ["H100"]},  # dead: not counted
    }
    assert placement.never_fits(table, gpus, kind) == why


def test_the_audit_writes_each_cell_as_its_sessions_user_on_its_node(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'registry.sqlite'}")
    try:
        audit = Audit(registry, {"n1": "host/n1"}.get)
        alice = LiveSession("s1", "alice", "", 1, None, node_id="n1")
        audit.record(alice, [{"time": 100.0, "code_sha256": "ab" * 32, "bytes": 5, "gpu": "GPU-1"}])
        cells = [e for e in registry.events(limit=10) if e["kind"] == "cell"]
        assert [(c["user"], c["node"], c["bytes"]) for c in cells] == [("alice", "host/n1", 5)]
    finally:
        registry.close()
