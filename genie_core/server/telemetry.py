"""What a server says about itself: host and GPU readings (ResourceMonitor), health, events
(kept in SQLite so they survive a restart), and the node's description, pushed to every client
on its heartbeat connection and answered on request (`info`)."""

from __future__ import annotations

import logging
import os
import platform
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..config import ClusterConfig, state_dir
from ..events import ClusterEvent, EventBus, EventType
from ..monitoring import GPUSource, NvmlSource, SimulatedGPUSource, create_resource_monitor
from ..monitoring.history_store import HistoryStore
from ..nodes import GPUInfo, NodeInfo
from ..protocol import PROTOCOL_VERSION, MessageType, contents
from ..version import __version__

log = logging.getLogger("genie.server")

Broadcast = Callable[[MessageType, Mapping[str, Any]], None]  # to every session, on the loop thread


class Telemetry:
    def __init__(
        self,
        config: ClusterConfig,
        node_id: str,
        gpus: list[GPUInfo],
        gpu_reason: str,
        gpu_source: GPUSource | None = None,
        owners: Callable[[], dict[int, dict[str, Any]]] = dict,
    ) -> None:
        self.config, self.node_id, self.gpus, self.gpu_reason = config, node_id, gpus, gpu_reason
        self.bus = EventBus()
        self.monitor: Any = None
        self.store: HistoryStore | None = None
        self.started = time.time()
        self._gpu_source = gpu_source
        # pid -> the session it works for ({"session", "name", "user", "host"})
        self.owners = owners

    def start(self, address: str, broadcast: Broadcast) -> None:
        """Poll the host and GPUs, and pass readings and events on through `broadcast`."""

        def on_event(event: ClusterEvent) -> None:
            if self.store is not None and event.type is not EventType.METRICS:
                try:
                    self.store.add_event(event)
                except Exception:
                    log.exception("could not store an event")
            broadcast(MessageType.EVENT, event.to_dict())

        def on_reading(node: NodeInfo) -> None:  # the monitor's thread
            health = self.monitor.health_report if self.monitor is not None else None
            broadcast(
                MessageType.METRICS,
                contents.Metrics(node=self.labelled(node.to_dict()), health=health.to_dict() if health else None),
            )

        self.bus.subscribe(on_event)
        if not self.config.enable_gpu_monitoring:
            return
        folder = state_dir(self.node_id, self.config.state_dir)
        try:
            self.store = HistoryStore(folder / "history.sqlite")
            self.bus.preload(self.store.events(200))
        except Exception as exc:  # a read-only home must not stop the server
            log.warning("metric history will not survive a restart: %s", exc)
        source = self._gpu_source
        if source is None:
            source = (
                SimulatedGPUSource(self.config.simulate_gpus)
                if self.config.simulate_gpus
                else NvmlSource(indices=self.config.gpus)
            )
        local = NodeInfo(self.node_id, socket.gethostname(), "server", address, "tcp", disk_path=str(folder))
        self.monitor = create_resource_monitor(
            local, self.config, bus=self.bus, gpu_source=source, store=self.store, on_reading=on_reading
        )
        self.monitor.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop sampling. A poll still under way after `timeout` s keeps the history file open
        for its last write (SQLite's WAL keeps the file whole if the process ends meanwhile)."""
        stopped = self.monitor.stop(timeout) if self.monitor is not None else True
        if self.store is not None and stopped:
            self.store.close()

    def node_info(self, address: str, transport: dict[str, Any], limits: contents.Limits) -> contents.NodeDescription:
        """The node as a client sees it in its welcome and in `genie status`."""
        return {
            "node_id": self.node_id,
            "hostname": socket.gethostname(),
            "address": address,
            "pid": os.getpid(),
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "gpus": [g.description() for g in self.gpus],
            "gpu_reason": self.gpu_reason,
            "simulated_gpus": self.config.simulate_gpus or 0,  # fake readings (--simulate-gpus), labelled so
            "transport": transport,
            "encrypted": self.config.encrypt,
            "limits": limits,
            "started": self.started,
        }

    def labelled(self, node: dict[str, Any]) -> dict[str, Any]:
        """The readings with each GPU process's session, when it is one of a session's workers (or
        something a worker started): per-session GPU memory and utilization, as nvitop shows per process."""
        processes = [p for g in node.get("gpus") or [] for p in g.get("processes") or []]
        if processes:
            owners = self.owners()
            for p in processes:
                p.update(owners.get(int(p.get("pid") or 0), {}))
        return node

    def report(self, history_points: int, events: int) -> contents.TelemetryReport:
        """Readings, health, history and events, for an `info` request."""
        monitor = self.monitor
        latest = monitor.latest if monitor is not None else None
        health = monitor.health_report if monitor is not None else None
        return {
            "metrics": self.labelled(latest.to_dict()) if latest else None,
            "health": health.to_dict() if health else None,
            "history": monitor.history_all(points=history_points) if monitor else {},
            "events": [e.to_dict() for e in self.bus.history(limit=events)],
            "monitoring": {
                "enabled": monitor is not None,
                "interval": self.config.gpu_poll_interval,
                "source": getattr(monitor.gpu_source, "name", "") if monitor else "",
            },
        }
