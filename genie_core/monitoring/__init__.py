"""Resource monitoring and health: readings (NVML, psutil), events, grades, history."""

from .gpu_source import GPUSource, NvmlSource, SimulatedGPUSource, StaticGPUSource
from .health import Grade, HealthCheck, HealthChecker, HealthReport
from .resource_monitor import ResourceMonitor, Thresholds, create_resource_monitor

__all__ = [
    "GPUSource",
    "Grade",
    "HealthCheck",
    "HealthChecker",
    "HealthReport",
    "NvmlSource",
    "ResourceMonitor",
    "SimulatedGPUSource",
    "StaticGPUSource",
    "Thresholds",
    "create_resource_monitor",
]
