"""Health grades for a node, from its readings. The rules follow DCGM's health watches:
uncorrectable memory errors and lost GPUs are serious, throttling and heat are warnings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ..events import ClusterEvent, EventBus, EventType, Severity
from ..nodes import GPUInfo, NodeInfo

# XIDs that DCGM and NVIDIA's XID catalogue treat as needing attention, with their meaning.
CRITICAL_XIDS = {
    48: "double-bit ECC error",
    63: "row remapping event",
    64: "row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
}
THROTTLE_WARNINGS = {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"}


class Grade(str, enum.Enum):
    HEALTHY = "HEALTHY"
    DEGRADED = "DEGRADED"
    UNHEALTHY = "UNHEALTHY"
    CRITICAL = "CRITICAL"

    @property
    def rank(self) -> int:
        return list(Grade).index(self)


def worst(grades: list[Grade]) -> Grade:
    return max(grades, key=lambda g: g.rank, default=Grade.HEALTHY)


@dataclass
class HealthCheck:
    name: str  # "gpu0", "cpu", "memory", "disk", "network", "peers"
    grade: Grade
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "grade": self.grade.value, "reason": self.reason}


@dataclass
class HealthReport:
    node: str
    grade: Grade
    checks: list[HealthCheck] = field(default_factory=list)
    time: float = field(default_factory=time.time)

    @property
    def reasons(self) -> list[str]:
        return [c.reason for c in self.checks if c.grade is not Grade.HEALTHY]

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "grade": self.grade.value,
            "checks": [c.to_dict() for c in self.checks],
            "time": self.time,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HealthReport:
        checks = [HealthCheck(c["name"], Grade(c["grade"]), c["reason"]) for c in d.get("checks", [])]
        return cls(d["node"], Grade(d["grade"]), checks, float(d["time"]))


@dataclass
class HealthThresholds:
    memory_degraded_percent: float = 90.0
    memory_unhealthy_percent: float = 97.0
    disk_degraded_percent: float = 90.0
    disk_unhealthy_percent: float = 98.0
    rtt_degraded_s: float = 0.5
    temperature_fallback_slowdown: float = 85.0  # when NVML does not give the GPU's own threshold


def check_gpu(gpu: GPUInfo, t: HealthThresholds) -> HealthCheck:
    name = f"gpu{gpu.index}"
    label = f"GPU {gpu.index}"
    if gpu.lost:
        return HealthCheck(name, Grade.CRITICAL, f"{label}: cannot be read any more (fallen off the bus?)")
    findings: list[tuple[Grade, str]] = []
    for xid in gpu.xid_errors:
        meaning = CRITICAL_XIDS.get(xid, "critical error")
        grade = Grade.CRITICAL if xid == 79 else Grade.UNHEALTHY if xid in (48, 64, 95) else Grade.DEGRADED
        findings.append((grade, f"{label}: XID {xid} ({meaning})"))
    if gpu.ecc_volatile_dbe:
        findings.append((Grade.UNHEALTHY, f"{label}: {gpu.ecc_volatile_dbe} volatile double-bit ECC errors"))
    if gpu.remapped_rows_failure:
        findings.append((Grade.CRITICAL, f"{label}: row remapping failed; the GPU needs service"))
    if gpu.remapped_rows_pending:
        findings.append((Grade.DEGRADED, f"{label}: row remapping pending; reset the GPU"))
    if gpu.retired_pages_pending:
        findings.append((Grade.DEGRADED, f"{label}: page retirement pending; reset the GPU"))
    if gpu.temperature is not None:
        shutdown = gpu.temperature_shutdown
        slowdown = gpu.temperature_slowdown or t.temperature_fallback_slowdown
        if shutdown is not None and gpu.temperature >= shutdown:
            findings.append(
                (Grade.CRITICAL, f"{label}: {gpu.temperature:.0f} °C, at its shutdown threshold ({shutdown:.0f} °C)")
            )
        elif gpu.temperature >= slowdown:
            findings.append(
                (Grade.UNHEALTHY, f"{label}: {gpu.temperature:.0f} °C, past its slowdown threshold ({slowdown:.0f} °C)")
            )
    throttled = sorted(set(gpu.throttle_reasons or []) & THROTTLE_WARNINGS)
    if throttled:
        findings.append((Grade.DEGRADED, f"{label}: clocks throttled ({', '.join(throttled)})"))
    if not findings:
        return HealthCheck(name, Grade.HEALTHY, f"{label}: ok")
    grade = worst([g for g, _ in findings])
    return HealthCheck(name, grade, "; ".join(r for g, r in sorted(findings, key=lambda f: -f[0].rank)))


def _percent_check(
    name: str, label: str, percent: float | None, degraded: float, unhealthy: float, detail: str
) -> HealthCheck:
    if percent is None:
        return HealthCheck(name, Grade.HEALTHY, f"{label}: unknown")
    grade = Grade.UNHEALTHY if percent >= unhealthy else Grade.DEGRADED if percent >= degraded else Grade.HEALTHY
    return HealthCheck(name, grade, f"{label}: {percent:.0f}% used{detail}")


class HealthChecker:
    """Grades a `NodeInfo`; emits HEALTH_CHANGED (and NODE_DEGRADED / NODE_RECOVERED) on change."""

    def __init__(self, node_id: str, bus: EventBus | None = None, thresholds: HealthThresholds | None = None) -> None:
        self.node_id = node_id
        self.bus = bus
        self.thresholds = thresholds or HealthThresholds()
        self.last: HealthReport | None = None

    def check(self, node: NodeInfo, *, rtt: float | None = None, peers_lost: list[str] | None = None) -> HealthReport:
        t = self.thresholds
        checks = [check_gpu(g, t) for g in node.gpus]
        cpu = node.cpu_percent
        # Shown, never graded: a GPU server feeding its GPUs is often 100% busy (DCGM's health
        # watches leave host CPU out too); memory and disk pressure are what hurt.
        checks.append(HealthCheck("cpu", Grade.HEALTHY, f"CPU: {cpu:.0f}% busy" if cpu is not None else "CPU: unknown"))
        gib = 1024**3
        mem_detail = (
            f" ({(node.memory_total - node.memory_available) / gib:.1f} of {node.memory_total / gib:.1f} GiB)"
            if node.memory_total and node.memory_available is not None
            else ""
        )
        checks.append(
            _percent_check(
                "memory",
                "memory",
                node.memory_percent,
                t.memory_degraded_percent,
                t.memory_unhealthy_percent,
                mem_detail,
            )
        )
        disk_detail = (
            f" ({node.disk_free / gib:.1f} GiB free on {node.disk_path})" if node.disk_free is not None else ""
        )
        checks.append(
            _percent_check(
                "disk", "disk", node.disk_percent, t.disk_degraded_percent, t.disk_unhealthy_percent, disk_detail
            )
        )
        if rtt is not None:
            slow = rtt >= t.rtt_degraded_s
            checks.append(
                HealthCheck(
                    "network",
                    Grade.DEGRADED if slow else Grade.HEALTHY,
                    f"network: heartbeat round trip {rtt * 1000:.1f} ms",
                )
            )
        if peers_lost is not None:
            checks.append(
                HealthCheck(
                    "peers",
                    Grade.UNHEALTHY if peers_lost else Grade.HEALTHY,
                    f"peers: lost {', '.join(peers_lost)}" if peers_lost else "peers: all reachable",
                )
            )
        report = HealthReport(self.node_id, worst([c.grade for c in checks]), checks)
        self._emit_changes(report)
        self.last = report
        return report

    def _emit_changes(self, report: HealthReport) -> None:
        before = self.last.grade if self.last is not None else Grade.HEALTHY
        if self.bus is None or report.grade is before:
            return
        severity = {
            Grade.HEALTHY: Severity.INFO,
            Grade.DEGRADED: Severity.WARNING,
            Grade.UNHEALTHY: Severity.ERROR,
            Grade.CRITICAL: Severity.CRITICAL,
        }[report.grade]
        reasons = report.reasons
        data = {
            "grade": report.grade.value,
            "previous": before.value,
            "reasons": reasons,
            "message": f"health {before.value} → {report.grade.value}" + (f": {reasons[0]}" if reasons else ""),
        }
        self.bus.emit(ClusterEvent(EventType.HEALTH_CHANGED, self.node_id, severity, data))
        if before is Grade.HEALTHY:
            self.bus.emit(ClusterEvent(EventType.NODE_DEGRADED, self.node_id, severity, data))
        elif report.grade is Grade.HEALTHY:
            self.bus.emit(ClusterEvent(EventType.NODE_RECOVERED, self.node_id, Severity.INFO, data))
