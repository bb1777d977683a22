"""One node's readings for the pool: a Ray actor pinned to the node (node affinity) that runs the
same ResourceMonitor and HealthChecker as `genie serve` and pushes a compact, signed reading to
the pool endpoint once a second. The pool keeps the latest for `genie pool status` and a history
in its registry."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
from typing import Any

import zmq

from ..events import EventBus
from ..monitoring.gpu_source import NvmlSource, SimulatedGPUSource
from ..monitoring.health import HealthChecker
from ..monitoring.resource_monitor import ResourceMonitor
from ..nodes import NodeInfo

PREFIX = "m:"  # monitor actors' names: m:<node id>


def compact(node: NodeInfo, health: Any) -> dict[str, Any]:
    """What the pool needs of a reading: a few hundred bytes a GPU, not the whole NodeInfo."""
    return {
        "time": node.time,
        "cpu_percent": node.cpu_percent,
        "memory_percent": node.memory_percent,
        "simulated": node.gpu_source == "simulated",
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "utilization": g.utilization,
                "memory_used": g.memory_used,
                "memory_total": g.memory_total,
                "temperature": g.temperature,
            }
            for g in node.gpus
        ],
        "health": {"grade": health.grade.value, "reasons": health.reasons[:5]} if health is not None else None,
    }


def sign(body: bytes, key: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


class NodeMonitor:
    """Made by the pool with `ray.remote(...)(NodeMonitor).options(scheduling_strategy=node affinity)`."""

    def __init__(self, sink: str, key: str, simulate_gpus: int = 0, interval: float = 1.0) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self._sink, self._key = sink, bytes.fromhex(key)
        self._changed = threading.Event()
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[Any] | None = None
        local = NodeInfo(self.node_id, socket.gethostname(), "server", ray.util.get_node_ip_address(), "tcp")
        source = SimulatedGPUSource(simulate_gpus) if simulate_gpus else NvmlSource()
        bus = EventBus()
        self.monitor = ResourceMonitor(
            local,
            gpu_source=source,
            interval=interval,
            bus=bus,
            health=HealthChecker(self.node_id, bus),
            on_reading=self._push,
        )
        self.monitor.start()

    def set_sink(self, sink: str, key: str) -> None:
        """A restarted pool listens elsewhere, with a new key."""
        with self._lock:
            self._sink, self._key = sink, bytes.fromhex(key)
            self._changed.set()

    def _push(self, node: NodeInfo) -> None:  # the monitor's thread: the only one that uses the socket
        with self._lock:
            sink, key = self._sink, self._key
        if self._sock is None or self._changed.is_set():
            self._changed.clear()
            if self._sock is not None:
                self._sock.close(0)
            self._sock = self._ctx.socket(zmq.PUSH)
            self._sock.linger = 0
            self._sock.sndhwm = 10  # a pool that is away gets the newest readings, not a backlog
            self._sock.connect(sink)
        body = json.dumps({"node_id": self.node_id, **compact(node, self.monitor.health_report)}).encode()
        try:
            self._sock.send_multipart([body, sign(body, key)], zmq.NOBLOCK)
        except zmq.Again:
            pass

    def ping(self) -> str:
        return self.node_id
