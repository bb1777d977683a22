"""`ResourceMonitor`: polls the host (psutil) and its GPUs (a `GPUSource`) on a background
thread, keeps a bounded rolling history, and emits events when a reading crosses a threshold,
with hysteresis so a value hovering at a threshold does not cause an event storm."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from ..errors import ConfigError
from ..events import ClusterEvent, EventBus, EventType, Severity
from ..nodes import GPUInfo, NodeInfo
from ..threads import name_os_thread
from .gpu_source import GPUSource, NvmlSource
from .health import HealthChecker, HealthReport
from .history_store import HistoryStore

log = logging.getLogger("genie.monitor")
MIN_INTERVAL = 0.1


@dataclass
class Thresholds:
    """Each condition turns on at one value and off at another (the gap is the hysteresis)."""

    gpu_busy_percent: float = 90.0  # GPU_UNAVAILABLE at or above
    gpu_free_percent: float = 70.0  # GPU_AVAILABLE again below
    overheat_margin: float = 3.0  # GPU_OVERHEATED this many °C below the GPU's slowdown threshold
    overheat_fallback: float = 85.0  # when NVML does not report the slowdown threshold
    cool_down: float = 5.0  # ...and over again this many °C lower
    power_limit_ratio: float = 0.98  # GPU_POWER_LIMIT at or above this share of the limit
    power_clear_ratio: float = 0.90
    memory_pressure_percent: float = 90.0  # MEMORY_PRESSURE (host or GPU memory)
    memory_clear_percent: float = 85.0


class _Latch:
    """On at `on`, off below `off`; reports edges only."""

    def __init__(self) -> None:
        self.state: dict[str, bool] = {}

    def update(self, key: str, value: float | None, on: float, off: float, initial: bool | None = False) -> bool | None:
        if value is None:
            return None
        before = self.state.get(key)
        if before is None:
            if initial is None:  # start from the current state, silently
                self.state[key] = value >= on
                return None
            before = initial
        now = value >= on if not before else value >= off
        self.state[key] = now
        return now if now != before else None


def read_host(disk_path: str) -> dict[str, Any]:
    """One psutil snapshot of the host (about a millisecond)."""
    mem = psutil.virtual_memory()
    try:
        disk = psutil.disk_usage(disk_path)
        disk_values = {"disk_total": disk.total, "disk_used": disk.used, "disk_free": disk.free}
    except OSError:
        disk_values = {}
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu_count": psutil.cpu_count(),
        "cpu_percent": psutil.cpu_percent(interval=None),
        "load_avg": load,
        "memory_total": mem.total,
        "memory_used": mem.used,
        "memory_available": mem.available,
        **disk_values,
    }


def metric_values(node: NodeInfo) -> dict[str, float]:
    """The numbers kept in history, by key (`cpu_percent`, `gpu0.utilization`, ...)."""
    values: dict[str, Any] = {"cpu_percent": node.cpu_percent, "memory_percent": node.memory_percent}
    for g in node.gpus:
        for name in ("utilization", "memory_used", "temperature", "power_draw"):
            values[f"gpu{g.index}.{name}"] = getattr(g, name)
    return {k: float(v) for k, v in values.items() if v is not None}


class ResourceMonitor:
    def __init__(
        self,
        local_node: NodeInfo,
        *,
        gpu_source: GPUSource | None = None,
        interval: float = 1.0,
        thresholds: Thresholds | None = None,
        bus: EventBus | None = None,
        health: HealthChecker | None = None,
        health_interval: float = 5.0,
        history_length: int = 600,
        store: HistoryStore | None = None,
        on_reading: Callable[[NodeInfo], None] | None = None,
    ) -> None:
        if interval < MIN_INTERVAL:
            raise ConfigError(
                f"gpu_poll_interval {interval} s is too fast: NVML calls serialize in the driver; "
                f"use {MIN_INTERVAL} s or more"
            )
        self.local_node = local_node
        self.gpu_source = gpu_source if gpu_source is not None else NvmlSource()
        self.interval = interval
        self.thresholds = thresholds or Thresholds()
        self.bus = bus or EventBus()
        self.health = health
        self.health_interval = health_interval
        self.store = store
        self.on_reading = on_reading
        self.latest: NodeInfo | None = None
        self.health_report: HealthReport | None = None
        self._history: dict[str, deque[tuple[float, float]]] = {}
        self._history_length = history_length
        self._latch = _Latch()
        self._known_gpus: dict[int, GPUInfo] = {}
        self._last_health = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement
        if store is not None:
            for key, points in store.metrics(history_length).items():
                self._history[key] = deque(points, maxlen=history_length)

    # -- polling --------------------------------------------------------------------------
    def poll_once(self) -> NodeInfo:
        t = time.time()
        base = self.local_node
        gpus, reason = self.gpu_source.read()
        gpus = self._mark_missing(gpus)
        node = NodeInfo(
            node_id=base.node_id,
            hostname=base.hostname or socket.gethostname(),
            role=base.role,
            address=base.address,
            backend=base.backend,
            status="online",
            time=t,
            disk_path=base.disk_path or os.path.expanduser("~"),
            gpus=gpus,
            gpu_reason=reason,
            gpu_source=getattr(self.gpu_source, "name", ""),
        )
        for key, value in read_host(node.disk_path).items():
            setattr(node, key, value)
        values = metric_values(node)
        with self._lock:
            self.latest = node
            for key, value in values.items():
                self._history.setdefault(key, deque(maxlen=self._history_length)).append((t, value))
        if self.store is not None:
            try:
                self.store.add_metrics(t, values)
            except Exception:
                log.exception("could not write metric history")
        self._emit_threshold_events(node)
        if self.health is not None and (
            time.monotonic() - self._last_health >= self.health_interval or self.health_report is None
        ):
            self._last_health = time.monotonic()
            self.health_report = self.health.check(node)
        if self.on_reading is not None:
            self.on_reading(node)
        return node

    def _mark_missing(self, gpus: list[GPUInfo]) -> list[GPUInfo]:
        """A GPU seen before and absent now is reported lost, not silently dropped."""
        present = {g.index for g in gpus}
        for g in gpus:
            if not g.lost:
                self._known_gpus[g.index] = g
        missing = [
            GPUInfo(index=i, uuid=old.uuid, name=old.name, lost=True)
            for i, old in self._known_gpus.items()
            if i not in present
        ]
        return sorted(gpus + missing, key=lambda g: g.index)

    def _emit(self, kind: EventType, severity: Severity, message: str, **data: Any) -> None:
        self.bus.emit(ClusterEvent(kind, self.local_node.node_id, severity, {"message": message, **data}))

    def _emit_threshold_events(self, node: NodeInfo) -> None:
        th = self.thresholds
        latch = self._latch
        for g in node.gpus:
            label = f"GPU {g.index}"
            if g.lost:
                if latch.update(f"gpu{g.index}.lost", 1.0, 1.0, 1.0) is True:
                    self._emit(
                        EventType.GPU_UNAVAILABLE,
                        Severity.CRITICAL,
                        f"{label} can no longer be read",
                        gpu=g.index,
                        lost=True,
                    )
                continue
            if latch.update(f"gpu{g.index}.lost", 0.0, 1.0, 1.0) is False:
                self._emit(EventType.GPU_AVAILABLE, Severity.INFO, f"{label} is readable again", gpu=g.index)
            edge = latch.update(
                f"gpu{g.index}.busy", g.utilization, th.gpu_busy_percent, th.gpu_free_percent, initial=None
            )
            if edge is not None:
                kind = EventType.GPU_UNAVAILABLE if edge else EventType.GPU_AVAILABLE
                self._emit(
                    kind,
                    Severity.INFO,
                    f"{label} {'busy' if edge else 'available'}: {g.utilization:.0f}% utilization",
                    gpu=g.index,
                    utilization=g.utilization,
                )
            limit = (g.temperature_slowdown or th.overheat_fallback + th.overheat_margin) - th.overheat_margin
            edge = latch.update(f"gpu{g.index}.hot", g.temperature, limit, limit - th.cool_down)
            if edge is not None:
                self._emit(
                    EventType.GPU_OVERHEATED,
                    Severity.WARNING if edge else Severity.INFO,
                    f"{label} {'overheating' if edge else 'cooled down'}: "
                    f"{g.temperature:.0f} °C (limit {limit:.0f} °C)",
                    gpu=g.index,
                    active=edge,
                    temperature=g.temperature,
                    limit=limit,
                )
            ratio = None if g.power_draw is None or not g.power_limit else g.power_draw / g.power_limit
            edge = latch.update(f"gpu{g.index}.power", ratio, th.power_limit_ratio, th.power_clear_ratio)
            if edge is not None:
                self._emit(
                    EventType.GPU_POWER_LIMIT,
                    Severity.WARNING if edge else Severity.INFO,
                    f"{label} {'at' if edge else 'below'} its power limit: {g.power_draw:.0f} of {g.power_limit:.0f} W",
                    gpu=g.index,
                    active=edge,
                    power_draw=g.power_draw,
                    power_limit=g.power_limit,
                )
            edge = latch.update(
                f"gpu{g.index}.memory", g.memory_percent, th.memory_pressure_percent, th.memory_clear_percent
            )
            if edge is not None:
                self._emit(
                    EventType.MEMORY_PRESSURE,
                    Severity.WARNING if edge else Severity.INFO,
                    f"{label} memory {'nearly full' if edge else 'pressure eased'}: {g.memory_percent:.0f}% used",
                    scope="gpu",
                    gpu=g.index,
                    active=edge,
                    percent=g.memory_percent,
                )
        edge = latch.update("host.memory", node.memory_percent, th.memory_pressure_percent, th.memory_clear_percent)
        if edge is not None:
            self._emit(
                EventType.MEMORY_PRESSURE,
                Severity.WARNING if edge else Severity.INFO,
                f"host memory {'nearly full' if edge else 'pressure eased'}: {node.memory_percent:.0f}% used",
                scope="host",
                active=edge,
                percent=node.memory_percent,
            )

    # -- the background thread --------------------------------------------------------------
    def start(self) -> ResourceMonitor:
        self._thread = threading.Thread(target=self._run, name="genie-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        name_os_thread()
        next_due = time.monotonic()
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:
                log.exception("resource poll failed")
            next_due += self.interval
            self._stop.wait(max(0.0, next_due - time.monotonic()))

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop polling. A poll under way (a slow NVML or /proc read on a loaded machine) is
        waited for up to `timeout` s; True if it ended, and only then is the GPU source closed
        (never under a call in flight). A process that is ending leaves the rest to its end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        self.gpu_source.close()
        return True

    def history(self, key: str) -> list[tuple[float, float]]:
        with self._lock:
            return list(self._history.get(key, ()))

    def history_all(self, points: int | None = None) -> dict[str, list[tuple[float, float]]]:
        with self._lock:
            return {k: list(v)[-points:] if points else list(v) for k, v in self._history.items()}


def create_resource_monitor(
    local_node: NodeInfo,
    config: Any = None,
    *,
    bus: EventBus | None = None,
    gpu_source: GPUSource | None = None,
    store: HistoryStore | None = None,
    on_reading: Callable[[NodeInfo], None] | None = None,
) -> ResourceMonitor:
    """A monitor set up from a `ClusterConfig` (poll interval, health checks and their interval)."""
    from ..config import ClusterConfig

    config = config or ClusterConfig.resolve()
    bus = bus or EventBus()
    health = HealthChecker(local_node.node_id, bus) if config.enable_health_checks else None
    return ResourceMonitor(
        local_node,
        gpu_source=gpu_source,
        interval=config.gpu_poll_interval,
        bus=bus,
        health=health,
        health_interval=config.health_check_interval,
        store=store,
        on_reading=on_reading,
    )
