"""What the worker's device says about itself when a client's device module asks
(`torch.remote_accelerator.memory_allocated`, `get_device_properties`, `Event.elapsed_time`)."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch


def clock(device: torch.device) -> Any:
    """A reading of the device's clock where the stream has got to: a CUDA event on a GPU (the
    device's own timeline), the time now on the CPU (ops there run as they arrive)."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_ms(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return float((end - start) * 1000.0)
    end.synchronize()
    return float(start.elapsed_time(end))


def answer(
    question: str, args: tuple[Any, ...], device: torch.device, held_bytes: Callable[[], int], clocks: dict[int, Any]
) -> Any:
    """The answer, as JSON-able values under torch.cuda's names."""
    if question == "elapsed":
        start, end = (clocks.get(rid) for rid in args)
        if start is None or end is None:
            raise RuntimeError("elapsed_time: an event's clock reading is gone (recorded in another session?)")
        return elapsed_ms(start, end)
    if device.type == "cuda":
        return _cuda(question, device, args)
    return _cpu(question, held_bytes)


def _cuda(question: str, device: torch.device, args: tuple[Any, ...]) -> Any:
    if question == "properties":
        p = torch.cuda.get_device_properties(device)
        return {
            "name": p.name,
            "total_memory": int(p.total_memory),
            "major": int(p.major),
            "minor": int(p.minor),
            "multi_processor_count": int(p.multi_processor_count),
            "uuid": str(getattr(p, "uuid", "")),
            "bf16_supported": bool(torch.cuda.is_bf16_supported()),
        }
    if question == "memory":
        stats = {k: int(v) for k, v in torch.cuda.memory_stats(device).items() if isinstance(v, (int, float))}
        stats.setdefault("allocated_bytes.all.current", 0)
        stats.setdefault("allocated_bytes.all.peak", 0)
        stats.setdefault("reserved_bytes.all.current", 0)
        stats.setdefault("reserved_bytes.all.peak", 0)
        free, total = torch.cuda.mem_get_info(device)
        return {**stats, "free_bytes": int(free), "total_bytes": int(total)}
    if question == "reset_peak":
        torch.cuda.reset_peak_memory_stats(device)
        return None
    if question == "reset_accumulated":
        torch.cuda.reset_accumulated_memory_stats(device)
        return None
    if question == "memory_summary":
        return torch.cuda.memory_summary(device, abbreviated=bool(args and args[0]))
    if question == "empty_cache":
        torch.cuda.empty_cache()
        return None
    raise ValueError(f"unknown question about the device: {question!r}")


def _cpu(question: str, held_bytes: Callable[[], int]) -> Any:
    import psutil

    if question == "properties":
        memory = psutil.virtual_memory()
        return {
            "name": f"CPU ({platform.processor() or platform.machine()}) of {platform.node()}",
            "total_memory": int(memory.total),
            "major": 0,
            "minor": 0,
            "multi_processor_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1,
            "uuid": "",
            "bf16_supported": True,
        }
    if question == "memory":  # the session's tensors, exactly; there is no caching allocator and no peak
        memory, held = psutil.virtual_memory(), held_bytes()  # (counted only when asked: it walks the store)
        return {
            "allocated_bytes.all.current": held,
            "reserved_bytes.all.current": held,
            "free_bytes": int(memory.available),
            "total_bytes": int(memory.total),
        }
    if question in ("reset_peak", "reset_accumulated", "empty_cache"):  # (no peak, no counts, no cache)
        return None
    if question == "memory_summary":  # (no caching allocator: what the session holds, and the machine)
        memory = psutil.virtual_memory()
        return (
            f"remote_accelerator (a CPU server, {platform.node()}): this session's tensors hold "
            f"{held_bytes():,} bytes; the machine has {memory.available:,} of {memory.total:,} bytes available"
        )
    raise ValueError(f"unknown question about the device: {question!r}")
