"""ResourceMonitor events and HealthChecker grades, from injected GPU readings.

The GPU readings here come from `StaticGPUSource`, a labelled fake at the hardware edge:
this machine has no NVIDIA GPU. Host readings (psutil) are real.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from genie_core.errors import ConfigError
from genie_core.events import EventBus, EventType
from genie_core.monitoring import Grade, HealthChecker, NvmlSource, ResourceMonitor, StaticGPUSource, Thresholds
from genie_core.monitoring.health import HealthThresholds, check_gpu
from genie_core.monitoring.history_store import HistoryStore
from genie_core.nodes import GPUInfo, NodeInfo


def gpu(index=0, **kw) -> GPUInfo:
    base = {
        "name": "Fake GPU (test)",
        "utilization": 10.0,
        "memory_used": 1 << 30,
        "memory_total": 16 << 30,
        "temperature": 50.0,
        "temperature_slowdown": 90.0,
        "temperature_shutdown": 95.0,
        "power_draw": 100.0,
        "power_limit": 300.0,
    }
    base.update(kw)
    return GPUInfo(index=index, **base)


class Scripted:
    """Feeds one list of readings per poll."""

    def __init__(self) -> None:
        self.next: list[GPUInfo] = [gpu()]

    def __call__(self) -> list[GPUInfo]:
        return self.next


@pytest.fixture
def rig(tmp_path):
    script = Scripted()
    bus = EventBus()
    events = []
    bus.subscribe(events.append)
    monitor = ResourceMonitor(
        NodeInfo("node-t", disk_path=str(tmp_path)), gpu_source=StaticGPUSource(script), bus=bus, interval=0.1
    )
    return script, monitor, events


def kinds(events, kind):
    return [e for e in events if e.type is kind]


def test_node_info_round_trips_exactly():
    node = NodeInfo(
        "n",
        "host",
        gpus=[
            gpu(0, throttle_reasons=["hw_slowdown"], processes=[{"pid": 1, "memory_used": 5}]),
            gpu(1, lost=True, xid_errors=[79]),
        ],
        cpu_percent=12.5,
        load_avg=[0.1, 0.2, 0.3],
        memory_total=10,
        memory_available=4,
    )
    again = NodeInfo.from_dict(json.loads(json.dumps(node.to_dict())))
    assert again == node and again.to_dict() == node.to_dict()


def test_host_readings_are_real(rig):
    _, monitor, _ = rig
    node = monitor.poll_once()
    assert node.cpu_count >= 1 and node.memory_total > 0 and 0 < node.memory_percent < 100 and node.disk_free > 0


def test_poll_interval_below_a_tenth_of_a_second_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="too fast"):
        ResourceMonitor(NodeInfo("n"), gpu_source=StaticGPUSource(), interval=0.05)


def test_overheating_with_hysteresis(rig):
    script, monitor, events = rig
    for temp in [50, 88, 89, 87.5, 88.5, 86, 84, 88]:  # limit 87 = slowdown 90 - margin 3; cool-down below 82
        script.next = [gpu(temperature=temp)]
        monitor.poll_once()
    hot = kinds(events, EventType.GPU_OVERHEATED)
    assert [e.data["active"] for e in hot] == [True]  # hovering at the threshold does not storm
    script.next = [gpu(temperature=80)]
    monitor.poll_once()
    hot = kinds(events, EventType.GPU_OVERHEATED)
    assert [e.data["active"] for e in hot] == [True, False] and "cooled" in hot[-1].message


def test_availability_follows_utilization_with_hysteresis(rig):
    script, monitor, events = rig
    for util in [10, 95, 85, 92, 75, 65, 80]:
        script.next = [gpu(utilization=util)]
        monitor.poll_once()
    assert [e.type for e in events if e.type in (EventType.GPU_AVAILABLE, EventType.GPU_UNAVAILABLE)] == [
        EventType.GPU_UNAVAILABLE,
        EventType.GPU_AVAILABLE,
    ]


def test_power_limit(rig):
    script, monitor, events = rig
    for draw in [100, 297, 295, 280, 260]:
        script.next = [gpu(power_draw=draw)]
        monitor.poll_once()
    assert [e.data["active"] for e in kinds(events, EventType.GPU_POWER_LIMIT)] == [True, False]


def test_gpu_memory_pressure(rig):
    script, monitor, events = rig
    for used in [1, 15.5, 15, 13]:
        script.next = [gpu(memory_used=int(used * (1 << 30)))]
        monitor.poll_once()
    pressure = kinds(events, EventType.MEMORY_PRESSURE)
    assert [(e.data["scope"], e.data["active"]) for e in pressure] == [("gpu", True), ("gpu", False)]


def test_host_memory_pressure_from_real_readings(rig):
    _, monitor, events = rig
    monitor.thresholds = Thresholds(
        memory_pressure_percent=0.0, memory_clear_percent=0.0
    )  # any real reading is "pressure"
    monitor.poll_once()
    host = [e for e in kinds(events, EventType.MEMORY_PRESSURE) if e.data["scope"] == "host"]
    assert len(host) == 1 and host[0].data["percent"] > 0


def test_a_gpu_that_disappears_is_reported_lost(rig):
    script, monitor, events = rig
    script.next = [gpu(0), gpu(1)]
    monitor.poll_once()
    script.next = [gpu(0)]
    node = monitor.poll_once()
    assert node.gpus[1].lost
    lost = kinds(events, EventType.GPU_UNAVAILABLE)
    assert lost and lost[0].data["gpu"] == 1 and lost[0].severity.value == "critical"


def test_unknown_readings_stay_unknown_and_emit_nothing(rig):
    script, monitor, events = rig
    script.next = [GPUInfo(index=0, name="no sensors")]
    node = monitor.poll_once()
    assert node.gpus[0].temperature is None and node.gpus[0].power_draw is None
    assert not [e for e in events if e.type is not EventType.METRICS]


def test_history_is_bounded(rig):
    script, monitor, _ = rig
    monitor._history_length = 5
    monitor._history.clear()
    for i in range(8):
        script.next = [gpu(utilization=float(i))]
        monitor.poll_once()
    assert [v for _, v in monitor.history("gpu0.utilization")] == [3.0, 4.0, 5.0, 6.0, 7.0]


def test_background_polling_runs_at_the_interval(rig):
    _, monitor, _ = rig
    monitor.interval = 0.1
    monitor.start()
    time.sleep(0.75)
    monitor.stop()
    assert 4 <= len(monitor.history("cpu_percent")) <= 9


# -- health rules, one test each -----------------------------------------------------------

H = HealthThresholds()


@pytest.mark.parametrize(
    "reading, grade, words",
    [
        (gpu(), Grade.HEALTHY, "ok"),
        (gpu(ecc_volatile_dbe=3), Grade.UNHEALTHY, "3 volatile double-bit ECC errors"),
        (gpu(retired_pages_pending=True), Grade.DEGRADED, "page retirement pending"),
        (gpu(remapped_rows_pending=True), Grade.DEGRADED, "row remapping pending"),
        (gpu(remapped_rows_failure=True), Grade.CRITICAL, "row remapping failed"),
        (gpu(xid_errors=[79]), Grade.CRITICAL, "XID 79 (GPU has fallen off the bus)"),
        (gpu(xid_errors=[48]), Grade.UNHEALTHY, "XID 48"),
        (gpu(xid_errors=[63]), Grade.DEGRADED, "XID 63"),
        (gpu(throttle_reasons=["hw_thermal_slowdown", "gpu_idle"]), Grade.DEGRADED, "throttled (hw_thermal_slowdown)"),
        (gpu(throttle_reasons=["sw_power_cap", "gpu_idle"]), Grade.HEALTHY, "ok"),
        (gpu(temperature=91), Grade.UNHEALTHY, "past its slowdown threshold (90 °C)"),
        (gpu(temperature=96), Grade.CRITICAL, "shutdown threshold"),
        (gpu(temperature=86, temperature_slowdown=None), Grade.UNHEALTHY, "(85 °C)"),
        (GPUInfo(index=2, lost=True), Grade.CRITICAL, "GPU 2: cannot be read"),
    ],
)
def test_gpu_health_rules(reading, grade, words):
    check = check_gpu(reading, H)
    assert check.grade is grade and words in check.reason


def node_with(**kw) -> NodeInfo:
    base = {
        "cpu_percent": 10.0,
        "memory_total": 100,
        "memory_available": 60,
        "disk_total": 100,
        "disk_used": 50,
        "disk_free": 50,
        "disk_path": "/",
    }
    base.update(kw)
    return NodeInfo("node-h", **base)


@pytest.mark.parametrize(
    "kw, name, grade",
    [
        ({"cpu_percent": 100.0}, "cpu", Grade.HEALTHY),  # shown, not graded: a GPU server often is
        ({"memory_available": 8}, "memory", Grade.DEGRADED),
        ({"memory_available": 2}, "memory", Grade.UNHEALTHY),
        ({"disk_used": 95, "disk_free": 5}, "disk", Grade.DEGRADED),
        ({"disk_used": 99, "disk_free": 1}, "disk", Grade.UNHEALTHY),
    ],
)
def test_host_health_rules(kw, name, grade):
    report = HealthChecker("node-h").check(node_with(**kw))
    check = next(c for c in report.checks if c.name == name)
    assert check.grade is grade and report.grade is grade
    if name == "cpu":
        assert check.reason == "CPU: 100% busy"


def test_network_and_peer_rules():
    report = HealthChecker("n").check(node_with(), rtt=0.9, peers_lost=["gpu-2"])
    grades = {c.name: c.grade for c in report.checks}
    assert (
        grades["network"] is Grade.DEGRADED and grades["peers"] is Grade.UNHEALTHY and report.grade is Grade.UNHEALTHY
    )
    assert HealthChecker("n").check(node_with(), rtt=0.001, peers_lost=[]).grade is Grade.HEALTHY


def test_grade_changes_emit_degraded_changed_and_recovered():
    bus = EventBus()
    events = []
    bus.subscribe(events.append)
    checker = HealthChecker("node-h", bus)
    checker.check(node_with(gpus=[gpu()]))
    checker.check(node_with(gpus=[gpu(ecc_volatile_dbe=1)]))
    checker.check(node_with(gpus=[gpu(ecc_volatile_dbe=1)]))  # no change, no event
    checker.check(node_with(gpus=[gpu()]))
    assert [e.type for e in events] == [
        EventType.HEALTH_CHANGED,
        EventType.NODE_DEGRADED,
        EventType.HEALTH_CHANGED,
        EventType.NODE_RECOVERED,
    ]
    assert "double-bit" in events[0].data["message"]


# -- NVML ---------------------------------------------------------------------------------


def test_nvml_on_this_machine_reports_zero_gpus_with_a_reason():
    gpus, reason = NvmlSource().read()
    if gpus:
        pytest.skip("this machine has an NVIDIA GPU")
    assert reason


class FakeNvml:
    """FAKE NVML module (hardware edge): one GPU, some readings unsupported."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 1, 0
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 0, 1
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
    nvmlEventTypeXidCriticalError = 8

    def __init__(self):
        self.lost = False
        self.xids = [79]
        self.asked_since: list[int] = []

    def _unsupported(self, *a):
        raise self.NVMLError_NotSupported("Not Supported")

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return "h0"

    def nvmlDeviceGetUUID(self, h):
        return b"GPU-fake"

    def nvmlDeviceGetName(self, h):
        return b"Fake A100 (test)"

    def nvmlDeviceGetTemperatureThreshold(self, h, kind):
        return 88 if kind == 1 else 93

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 400_000

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1410

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceRegisterEvents(self, h, kinds, s):
        pass

    def nvmlEventSetFree(self, s):
        pass

    def nvmlEventSetWait_v2(self, s, timeout):
        if not self.xids:
            raise self.NVMLError("Timeout")
        return SimpleNamespace(device="h0", eventData=self.xids.pop())

    def nvmlDeviceGetMemoryInfo(self, h):
        if self.lost:
            raise self.NVMLError_GpuIsLost("GPU is lost")
        return SimpleNamespace(used=4 << 30, total=40 << 30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=55, memory=20)

    def nvmlDeviceGetTemperature(self, h, kind):
        return 61

    def nvmlDeviceGetPowerUsage(self, h):
        return 123_456

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1200 if kind == 1 else 1215

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x1 | 0x40

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return 2 if kind == 1 and counter == 0 else 0

    nvmlDeviceGetRetiredPages = nvmlDeviceGetRetiredPagesPendingStatus = _unsupported

    def nvmlDeviceGetRemappedRows(self, h):
        return (1, 0, True, False)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 4

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetPcieThroughput(self, h, kind):
        return 1000

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=42, usedGpuMemory=1 << 30), SimpleNamespace(pid=43, usedGpuMemory=None)]

    def nvmlDeviceGetProcessUtilization(self, h, last_seen):
        self.asked_since.append(last_seen)
        return [SimpleNamespace(pid=42, smUtil=37, memUtil=12, timeStamp=1000 + len(self.asked_since))]


def test_nvml_source_maps_readings_and_keeps_unsupported_ones_unknown():
    fake = FakeNvml()
    source = NvmlSource(nvml=fake)
    (g,), reason = source.read()
    assert reason == "" and g.name == "Fake A100 (test)" and g.uuid == "GPU-fake"
    assert (g.memory_used, g.memory_total, g.utilization, g.temperature) == (4 << 30, 40 << 30, 55.0, 61)
    assert (g.power_draw, g.power_limit, g.temperature_slowdown, g.temperature_shutdown) == (123.456, 400.0, 88, 93)
    assert g.throttle_reasons == ["gpu_idle", "hw_thermal_slowdown"]
    assert g.ecc_volatile_dbe == 2 and g.retired_pages_dbe is None and g.retired_pages_pending is None
    assert (g.remapped_rows_correctable, g.remapped_rows_pending) == (1, True)
    assert g.xid_errors == [79]
    assert g.processes == [
        {"pid": 42, "memory_used": 1 << 30, "sm_util": 37.0, "memory_util": 12.0},
        {"pid": 43, "memory_used": None, "sm_util": None, "memory_util": None},  # no sample: unknown, not 0
    ]
    source.read()
    assert fake.asked_since == [0, 1001]  # each poll asks only for samples newer than the last seen
    assert g.pcie_tx == 1024000.0
    fake.lost = True
    (g,), _ = source.read()
    assert g.lost and g.name == "Fake A100 (test)"
    assert check_gpu(g, H).grade is Grade.CRITICAL


# -- history survives a restart --------------------------------------------------------------


def test_history_store_survives_reopen_and_stays_bounded(tmp_path):
    path = tmp_path / "h.sqlite"
    store = HistoryStore(path, max_rows=50)
    for i in range(300):
        store.add_metrics(float(i), {"a": i, "b": 2 * i})
    from genie_core.events import ClusterEvent, Severity

    store.add_event(ClusterEvent(EventType.GPU_OVERHEATED, "n", Severity.WARNING, {"gpu": 0}))
    store.close()
    again = HistoryStore(path, max_rows=50)
    rows, nevents = again.count()
    assert rows <= 50 + 2 * 100 and nevents == 1
    assert again.metrics(limit_per_key=3)["a"] == [(297.0, 297.0), (298.0, 298.0), (299.0, 299.0)]
    assert again.events()[0].data == {"gpu": 0}
