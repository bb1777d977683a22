"""What a node and its GPUs look like at one moment. `None` means "unknown" (NVML gave no
reading), never a guess. `GPUInfo` is the one description of a GPU: a server's welcome carries
the part that does not change (`description()`), its readings carry all of it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .protocol.contents import GPUDescription


@dataclass
class GPUInfo:
    index: int
    uuid: str | None = None
    name: str | None = None
    memory_used: int | None = None  # bytes
    memory_total: int | None = None
    utilization: float | None = None  # percent
    memory_utilization: float | None = None
    temperature: float | None = None  # deg C
    temperature_slowdown: float | None = None  # the GPU's own slowdown threshold
    temperature_shutdown: float | None = None
    power_draw: float | None = None  # watts
    power_limit: float | None = None
    clock_sm: int | None = None  # MHz
    clock_memory: int | None = None
    clock_sm_max: int | None = None
    throttle_reasons: list[str] | None = None
    ecc_volatile_sbe: int | None = None
    ecc_volatile_dbe: int | None = None
    ecc_aggregate_sbe: int | None = None
    ecc_aggregate_dbe: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_tx: float | None = None  # bytes/s
    pcie_rx: float | None = None
    xid_errors: list[int] = field(default_factory=list)  # critical XIDs seen since the last reading
    processes: list[dict[str, Any]] | None = None  # [{pid, memory_used}]
    lost: bool = False  # was present, can no longer be read (fell off the bus)

    @property
    def memory_percent(self) -> float | None:
        if self.memory_used is None or not self.memory_total:
            return None
        return 100.0 * self.memory_used / self.memory_total

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def description(self) -> GPUDescription:
        """The GPU as a server's welcome describes it: what does not change, less what is unknown."""
        described: GPUDescription = {"index": self.index}
        if self.name is not None:
            described["name"] = self.name
        if self.uuid is not None:
            described["uuid"] = self.uuid
        if self.memory_total is not None:
            described["memory_total"] = self.memory_total
        return described

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GPUInfo:
        """From `to_dict()` or `description()` (what is not in it stays unknown)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class NodeInfo:
    node_id: str
    hostname: str = ""
    role: str = "server"
    address: str = ""
    backend: str = ""
    status: str = "online"
    last_heartbeat: float | None = None
    time: float = 0.0  # when this reading was taken
    cpu_count: int | None = None
    cpu_percent: float | None = None
    load_avg: list[float] | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    memory_available: int | None = None
    disk_path: str = ""
    disk_total: int | None = None
    disk_used: int | None = None
    disk_free: int | None = None
    gpus: list[GPUInfo] = field(default_factory=list)
    gpu_reason: str = ""  # why there are no GPUs
    gpu_source: str = ""  # "nvml", or "simulated" for a labelled fake

    @property
    def memory_percent(self) -> float | None:
        if self.memory_available is None or not self.memory_total:
            return None
        return 100.0 * (self.memory_total - self.memory_available) / self.memory_total

    @property
    def disk_percent(self) -> float | None:
        if self.disk_used is None or not self.disk_total:
            return None
        return 100.0 * self.disk_used / self.disk_total

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeInfo:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        values["gpus"] = [GPUInfo.from_dict(g) for g in d.get("gpus", [])]
        return cls(**values)
