"""The pool's machines as it knows them: Ray's node table, each node's newest signed reading, and
the readings sampled for history. Bookkeeping only: the endpoint asks Ray for the table."""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import socket
import urllib.parse
from collections.abc import Callable
from typing import Any

import zmq

from .monitor_actor import sign

History = tuple[float, str, int, float | None, float | None, float | None]  # time, node, GPU, util, memory, temp


def node_from_ray(entry: dict[str, Any]) -> dict[str, Any]:
    """One entry of `ray.nodes()` as the pool keeps it."""
    node_id = str(entry["NodeID"])
    resources = entry.get("Resources", {})
    return {
        "alive": bool(entry.get("Alive")),
        "gpus": int(resources.get("GPU", 0)),
        "name": f"{entry.get('NodeManagerHostname', '?')}/{node_id[:6]}",
        "ip": entry.get("NodeManagerAddress", ""),
        "death": entry.get("DeathReasonMessage", ""),
        "accelerators": sorted(k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")),
    }


class Nodes:
    """`table`: node id -> what Ray says of it; `readings`: node id -> its newest reading;
    `monitors`: node id -> its NodeMonitor actor (None for a node a test or benchmark plays)."""

    def __init__(self, history_every: float) -> None:
        self.table: dict[str, dict[str, Any]] = {}
        self.readings: dict[str, dict[str, Any]] = {}
        self.monitors: dict[str, Any] = {}
        self.key = secrets.token_bytes(32)  # signs the monitors' readings
        self.history_every = history_every  # seconds between a node's readings kept for history
        self.history: list[History] = []  # taken since the last flush
        self.taken = 0  # readings taken, all told

    def update(self, entries: list[dict[str, Any]], on_death: Callable[[str, dict[str, Any]], None]) -> None:
        """Ray's node table now. `on_death(node_id, node)` for each node that was alive and is dead,
        before the table is replaced: should it fail, the next update tells the death again. A dead
        node keeps the GPUs it had, so that its sessions' GPUs are still accounted for."""
        seen = {str(entry["NodeID"]): node_from_ray(entry) for entry in entries}
        for node_id, node in seen.items():
            before = self.table.get(node_id)
            if before is not None and not node["alive"]:
                node["gpus"] = before["gpus"]
                if before["alive"]:
                    on_death(node_id, node)
                    self.table[node_id] = node  # told: a failure later in this update does not tell it again
        self.table = seen

    def forget(self, node_id: str) -> None:
        """A dead node's monitor and reading go."""
        self.monitors.pop(node_id, None)
        self.readings.pop(node_id, None)

    def unwatched(self) -> list[tuple[str, dict[str, Any]]]:
        """Live GPU nodes without a monitor yet."""
        return [(nid, n) for nid, n in self.table.items() if n["alive"] and n["gpus"] and nid not in self.monitors]

    def name(self, node_id: str, default: str = "") -> str:
        return str(self.table.get(node_id, {}).get("name", default))

    def gpu_nodes(self) -> set[str]:
        """Live nodes with GPUs."""
        return {nid for nid, n in list(self.table.items()) if n["alive"] and n["gpus"]}

    def addresses(self) -> set[str]:
        """The machines' addresses, as Ray has them."""
        return {str(n["ip"]) for n in list(self.table.values()) if n.get("ip")}

    def drain(self, sock: zmq.Socket[Any]) -> None:
        """The readings waiting on the monitors' socket (at most 1,000 a call)."""
        for _ in range(1000):
            try:
                body, mac = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue
            self.take(body, mac)

    def take(self, body: bytes, mac: bytes) -> bool:
        """A monitor's signed reading: kept as its node's newest, and sampled for history once
        every `history_every` seconds. Unsigned, malformed or from an unknown node: dropped."""
        if not hmac.compare_digest(mac, sign(body, self.key)):
            return False
        try:
            reading = json.loads(body)
            node_id = str(reading["node_id"])
        except (ValueError, KeyError, TypeError):
            return False
        if node_id not in self.table:
            return False
        self.taken += 1
        before = self.readings.get(node_id)
        self.readings[node_id] = reading
        if before is None or reading.get("time", 0) - before.get("_kept", 0) >= self.history_every:
            reading["_kept"] = reading.get("time", 0)
            for g in reading.get("gpus", []):
                self.history.append(
                    (reading["time"], node_id, g["index"], g["utilization"], g["memory_used"], g["temperature"])
                )
        else:
            reading["_kept"] = before.get("_kept", 0)
        return True

    def flush_history(self) -> list[History]:
        """The rows sampled since the last flush, for the registry."""
        rows, self.history = self.history, []
        return rows


def host_addresses(url: str) -> set[str]:
    """The addresses of a database server named in `url` (none for SQLite or a bare path)."""
    host = urllib.parse.urlsplit(url).hostname if "://" in url else None
    if not host or url.startswith("sqlite"):
        return set()
    with contextlib.suppress(OSError):
        return {str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(host, None)}
    return set()
