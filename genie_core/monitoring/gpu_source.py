"""Where GPU readings come from. `NvmlSource` reads real GPUs; `StaticGPUSource` and
`SimulatedGPUSource` are labelled fakes for tests and for demos on machines without a GPU."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..nodes import GPUInfo

# Clock-event (throttle) reason bits, as NVML defines them.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


class GPUSource(Protocol):
    name: str

    def read(self) -> tuple[list[GPUInfo], str]:
        """Current readings, and the reason when there are no GPUs."""
        ...

    def close(self) -> None: ...


class NvmlSource:
    """Reads GPUs through NVML. Static facts (names, thresholds, limits) are read once; slow
    counters (aggregate ECC, retired pages, PCIe throughput) every `slow_every` polls, because
    NVML calls serialize in the driver; the processes on each GPU (memory, and SM and memory
    utilization since the last poll, as nvitop shows them) every poll. `nvml` is injectable
    (the pynvml module by default)."""

    name = "nvml"

    def __init__(self, nvml: Any = None, slow_every: int = 10, indices: list[int] | None = None) -> None:
        if nvml is None:
            try:
                import pynvml

                nvml = pynvml
            except ImportError:
                nvml = None
        self.nvml = nvml
        self.slow_every = max(1, slow_every)
        self.reason = ""
        self._handles: dict[int, Any] = {}
        self._static: dict[int, dict[str, Any]] = {}
        self._slow: dict[int, dict[str, Any]] = {}
        self._polls = 0
        self._seen_at: dict[int, int] = {}  # per GPU: NVML's timestamp of the last utilization sample read
        self._events: Any = None
        if nvml is None:
            self.reason = "nvidia-ml-py is not installed"
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:
            self.nvml = None
            self.reason = f"NVML unavailable ({exc})"
            return
        count = nvml.nvmlDeviceGetCount()
        wanted = range(count) if indices is None else [i for i in indices if i < count]
        for i in wanted:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            self._handles[i] = handle
            self._static[i] = self._read_static(handle)
        if not self._handles:
            self.reason = "NVML reports no GPUs"
        self._events = self._call(self._register_xid_events)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML call; a reading NVML does not support (or that fails) is None: unknown."""
        try:
            return fn(*args)
        except Exception as exc:
            if self.nvml is not None and isinstance(exc, getattr(self.nvml, "NVMLError_GpuIsLost", ())):
                raise
            return None

    def _read_static(self, h: Any) -> dict[str, Any]:
        n = self.nvml

        def text(v: Any) -> Any:
            return v.decode() if isinstance(v, bytes) else v

        mw = self._call(n.nvmlDeviceGetEnforcedPowerLimit, h)
        return {
            "uuid": text(self._call(n.nvmlDeviceGetUUID, h)),
            "name": text(self._call(n.nvmlDeviceGetName, h)),
            "temperature_slowdown": self._call(
                n.nvmlDeviceGetTemperatureThreshold, h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            ),
            "temperature_shutdown": self._call(
                n.nvmlDeviceGetTemperatureThreshold, h, n.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
            ),
            "power_limit": None if mw is None else mw / 1000.0,
            "clock_sm_max": self._call(n.nvmlDeviceGetMaxClockInfo, h, n.NVML_CLOCK_SM),
        }

    def _register_xid_events(self) -> Any:
        n = self.nvml
        event_set = n.nvmlEventSetCreate()
        for h in self._handles.values():
            self._call(n.nvmlDeviceRegisterEvents, h, n.nvmlEventTypeXidCriticalError, event_set)
        return event_set

    def _drain_xids(self) -> dict[int, list[int]]:
        """Critical XID events since the last poll, by GPU index (non-blocking)."""
        out: dict[int, list[int]] = {}
        if self._events is None:
            return out
        n = self.nvml
        by_handle = {id(h): i for i, h in self._handles.items()}
        for _ in range(64):
            try:
                data = n.nvmlEventSetWait_v2(self._events, 0)
            except Exception:
                break  # NVMLError_Timeout: nothing pending
            index = by_handle.get(id(data.device))
            if index is None:  # handles may be fresh objects: match by UUID
                uuid = self._call(n.nvmlDeviceGetUUID, data.device)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                index = next((i for i, s in self._static.items() if s["uuid"] == uuid), -1)
            out.setdefault(index, []).append(int(data.eventData))
        return out

    def _read_slow(self, h: Any) -> dict[str, Any]:
        n = self.nvml
        retired_sbe = self._call(
            n.nvmlDeviceGetRetiredPages, h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        )
        retired_dbe = self._call(n.nvmlDeviceGetRetiredPages, h, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pending = self._call(n.nvmlDeviceGetRetiredPagesPendingStatus, h)
        remap = self._call(n.nvmlDeviceGetRemappedRows, h)
        tx = self._call(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._call(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_RX_BYTES)
        return {
            "ecc_aggregate_sbe": self._call(
                n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_AGGREGATE_ECC
            ),
            "ecc_aggregate_dbe": self._call(
                n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_AGGREGATE_ECC
            ),
            "retired_pages_sbe": None if retired_sbe is None else len(retired_sbe),
            "retired_pages_dbe": None if retired_dbe is None else len(retired_dbe),
            "retired_pages_pending": None if pending is None else bool(pending),
            "remapped_rows_correctable": None if remap is None else int(remap[0]),
            "remapped_rows_uncorrectable": None if remap is None else int(remap[1]),
            "remapped_rows_pending": None if remap is None else bool(remap[2]),
            "remapped_rows_failure": None if remap is None else bool(remap[3]),
            "pcie_gen": self._call(n.nvmlDeviceGetCurrPcieLinkGeneration, h),
            "pcie_width": self._call(n.nvmlDeviceGetCurrPcieLinkWidth, h),
            "pcie_tx": None if tx is None else tx * 1024.0,  # NVML gives KB/s
            "pcie_rx": None if rx is None else rx * 1024.0,
        }

    def _processes(self, i: int, h: Any) -> list[dict[str, Any]] | None:
        """The compute processes on a GPU: memory, and utilization sampled since the last poll."""
        n = self.nvml
        procs = self._call(n.nvmlDeviceGetComputeRunningProcesses, h)
        if procs is None:
            return None
        samples = self._call(n.nvmlDeviceGetProcessUtilization, h, self._seen_at.get(i, 0)) or []
        util: dict[int, Any] = {}
        for s in samples:
            util[s.pid] = s
            self._seen_at[i] = max(self._seen_at.get(i, 0), int(s.timeStamp))
        out = []
        for p in procs:
            s = util.get(p.pid)
            out.append(
                {
                    "pid": int(p.pid),
                    "memory_used": None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                    "sm_util": None if s is None else float(s.smUtil),
                    "memory_util": None if s is None else float(s.memUtil),
                }
            )
        return out

    def _throttle(self, h: Any) -> list[str] | None:
        n = self.nvml
        fn = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = self._call(fn, h)
        if mask is None:
            return None
        return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]

    def read(self) -> tuple[list[GPUInfo], str]:
        if self.nvml is None:
            return [], self.reason
        n = self.nvml
        self._polls += 1
        slow_now = self._polls % self.slow_every == 1 or self.slow_every == 1
        xids = self._drain_xids()
        gpus = []
        for i, h in self._handles.items():
            static = self._static[i]
            try:
                if slow_now or i not in self._slow:
                    self._slow[i] = self._read_slow(h)
                mem = self._call(n.nvmlDeviceGetMemoryInfo, h)
                util = self._call(n.nvmlDeviceGetUtilizationRates, h)
                mw = self._call(n.nvmlDeviceGetPowerUsage, h)
                gpus.append(
                    GPUInfo(
                        index=i,
                        **static,
                        memory_used=None if mem is None else int(mem.used),
                        memory_total=None if mem is None else int(mem.total),
                        utilization=None if util is None else float(util.gpu),
                        memory_utilization=None if util is None else float(util.memory),
                        temperature=self._call(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
                        power_draw=None if mw is None else mw / 1000.0,
                        clock_sm=self._call(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM),
                        clock_memory=self._call(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_MEM),
                        throttle_reasons=self._throttle(h),
                        ecc_volatile_sbe=self._call(
                            n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC
                        ),
                        ecc_volatile_dbe=self._call(
                            n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
                        ),
                        xid_errors=xids.get(i, []),
                        processes=self._processes(i, h),
                        **self._slow[i],
                    )
                )
            except Exception:  # NVMLError_GpuIsLost: it fell off the bus
                gpus.append(
                    GPUInfo(index=i, uuid=static["uuid"], name=static["name"], lost=True, xid_errors=xids.get(i, []))
                )
        return gpus, "" if gpus else self.reason

    def close(self) -> None:
        if self.nvml is not None:
            if self._events is not None:
                self._call(self.nvml.nvmlEventSetFree, self._events)
            self._call(self.nvml.nvmlShutdown)
            self.nvml = None


class StaticGPUSource:
    """FAKE, for tests: returns whatever readings the test sets (a list, or a callable)."""

    name = "static (test fake)"

    def __init__(self, readings: list[GPUInfo] | Callable[[], list[GPUInfo]] | None = None, reason: str = "") -> None:
        self.readings = readings if readings is not None else []
        self.reason = reason

    def read(self) -> tuple[list[GPUInfo], str]:
        gpus = self.readings() if callable(self.readings) else self.readings
        return [GPUInfo.from_dict(g.to_dict()) for g in gpus], "" if gpus else self.reason

    def close(self) -> None:
        pass


class SimulatedGPUSource:
    """FAKE, labelled as such everywhere it shows: smoothly varying readings for N GPUs, for
    demos and browser tests on machines without an NVIDIA GPU (`genie serve --simulate-gpus N`)."""

    name = "simulated"

    def __init__(self, count: int) -> None:
        self.count = count
        self.t0 = time.monotonic()

    def read(self) -> tuple[list[GPUInfo], str]:
        t = time.monotonic() - self.t0
        gpus = []
        for i in range(self.count):
            wave = 0.5 + 0.5 * math.sin(t / 3.0 + i)
            total = 80 * 1024**3
            gpus.append(
                GPUInfo(
                    index=i,
                    uuid=f"GPU-simulated-{i}",
                    name=f"Simulated GPU {i} (fake)",
                    memory_used=int(total * (0.2 + 0.5 * wave)),
                    memory_total=total,
                    utilization=round(100 * wave, 1),
                    memory_utilization=round(60 * wave, 1),
                    temperature=round(40 + 35 * wave, 1),
                    temperature_slowdown=87.0,
                    temperature_shutdown=92.0,
                    power_draw=round(80 + 500 * wave, 1),
                    power_limit=700.0,
                    clock_sm=int(1000 + 980 * wave),
                    clock_memory=2619,
                    clock_sm_max=1980,
                    throttle_reasons=[],
                    ecc_volatile_sbe=0,
                    ecc_volatile_dbe=0,
                )
            )
        return gpus, ""

    def close(self) -> None:
        pass
