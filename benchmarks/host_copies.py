"""The worker's copies between a shared segment and the GPU (genie_core/worker/host_copies.py), each
way side by side, in one process, no server: host-to-device from a /dev/shm segment (what an upload
arrives in) and device-to-host into fresh memory (what a fetch sends), through PyTorch's own pageable
copy, the pinned staging ring (chunk sizes 4, 16 and 64 MiB) and the segment page-locked where it
lies (cudaHostRegister each time, and once for many copies: the DMA alone), against the anchors: a
copy from memory pinned by PyTorch, and the host's own copy rates (a memoryview assignment, as
`pack_into` does, and PyTorch's `copy_` on its threads), which bound what a ring can do.

No target of its own: these figures choose the default way (`GENIE_HOST_COPIES`), the chunk size
and the size under which PyTorch's own copy is used (RING_MIN). Without a GPU only the host's copy
rates are measured."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from unittest import mock

import torch

from genie_core.dataplane.base import median_time
from genie_core.dataplane.segment import Segment
from genie_core.worker import host_copies

GIB = 1024**3


def _rate(nbytes: int, fn: Callable[[], object], rounds: int, sync: Callable[[], None]) -> float:
    fn()  # warm: first touches, the ring's buffers, registrations of the allocator
    sync()
    return round(nbytes / median_time(lambda: (fn(), sync()), rounds) / GIB, 2)


def _guarded(out: dict, key: str, measure: Callable[[], object]) -> None:
    """out[key] = measure(), or the error it raised (one way failing leaves the others' figures)."""
    try:
        value = measure()
    except Exception as exc:  # (reported in the results, not hidden)
        out[key] = f"failed: {type(exc).__name__}: {exc}"[:300]
        return
    if value is not None:
        out[key] = value


def _host_rates(nbytes: int, rounds: int, segment: Segment) -> dict:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    mv = memoryview(src.numpy()).cast("B")
    into = torch.frombuffer(segment.view, dtype=torch.uint8, count=nbytes)

    def memoryview_copy() -> None:
        for start in range(0, nbytes, 64 << 20):  # as pack_into does
            segment.view[start : start + (64 << 20)] = mv[start : start + (64 << 20)]

    return {
        "host_memoryview_copy_gib_s": _rate(nbytes, memoryview_copy, rounds, lambda: None),
        "host_torch_copy_gib_s": _rate(nbytes, lambda: into.copy_(src), rounds, lambda: None),
        "host_threads": torch.get_num_threads(),
    }


def _gpu_rates(nbytes: int, rounds: int, segment: Segment) -> dict:
    dev = torch.device("cuda", 0)
    sync = torch.cuda.synchronize
    host = torch.frombuffer(segment.view, dtype=torch.uint8, count=nbytes)
    host.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
    on_gpu = host.to(dev)
    out: dict = {"gpu": torch.cuda.get_device_name(0)}

    def with_way(name: str, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with mock.patch.dict(os.environ, {"GENIE_HOST_COPIES": name}):
                return fn()

        return run

    # host to device, from the segment
    out["h2d_pageable_gib_s"] = _rate(nbytes, lambda: host.to(dev), rounds, sync)
    for chunk in (4 << 20, 16 << 20, 64 << 20):
        ring = host_copies.PinnedRing(dev, chunk=chunk)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        out[f"h2d_ring_{chunk >> 20}mib_gib_s"] = _rate(nbytes, lambda r=ring, d=dst: r.upload(host, d), rounds, sync)

    def register_once() -> None:  # the segment locked once, then copied from: the DMA alone
        cudart = torch.cuda.cudart()
        start = time.perf_counter()
        status = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
        out["register_1gib_s"] = round((time.perf_counter() - start) * GIB / nbytes, 4)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister failed: CUDA error {int(status)}")
        try:
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            out["h2d_registered_once_gib_s"] = _rate(nbytes, lambda: dst.copy_(host, non_blocking=True), rounds, sync)
        finally:
            cudart.cudaHostUnregister(host.data_ptr())

    _guarded(
        out,
        "h2d_register_each_time_gib_s",
        lambda: _rate(nbytes, with_way("register", lambda: host_copies.to_device(host, dev)), rounds, sync),
    )
    _guarded(out, "register_once", register_once)
    pinned = host.pin_memory()
    out["h2d_from_pinned_gib_s"] = _rate(nbytes, lambda: pinned.to(dev, non_blocking=True), rounds, sync)
    # device to host, into fresh memory (what a fetch sends)
    out["d2h_pageable_gib_s"] = _rate(nbytes, lambda: on_gpu.cpu(), rounds, sync)
    for chunk in (4 << 20, 16 << 20, 64 << 20):
        ring = host_copies.PinnedRing(dev, chunk=chunk)
        out[f"d2h_ring_{chunk >> 20}mib_gib_s"] = _rate(
            nbytes, lambda r=ring: r.download(on_gpu, torch.empty(nbytes, dtype=torch.uint8)), rounds, sync
        )
    _guarded(
        out,
        "d2h_register_fresh_gib_s",
        lambda: _rate(nbytes, with_way("register", lambda: host_copies.DeviceBytes(on_gpu).host()), rounds, sync),
    )
    out["d2h_into_pinned_gib_s"] = _rate(nbytes, lambda: pinned.copy_(on_gpu, non_blocking=True), rounds, sync)
    # where the ring starts to pay: each way's time over pageable's, per size (median of 15)
    ring = host_copies._ring(dev)
    for size in (256 << 10, 1 << 20, 4 << 20, 16 << 20):
        part, back = host[:size], on_gpu[:size]
        dst = torch.empty(size, dtype=torch.uint8, device=dev)
        to = _rate(size, lambda p=part: p.to(dev), 15, sync)
        to_ring = _rate(size, lambda p=part, d=dst, r=ring: r.upload(p, d), 15, sync)
        cpu = _rate(size, lambda b=back: b.cpu(), 15, sync)
        cpu_ring = _rate(
            size, lambda b=back, s=size, r=ring: r.download(b, torch.empty(s, dtype=torch.uint8)), 15, sync
        )
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        out[f"ring_over_pageable_{label}"] = f"to {to / to_ring:.2f}, cpu {cpu / cpu_ring:.2f}"
    return out


def run(quick: bool = False) -> dict:
    nbytes = (64 if quick else 1024) << 20
    rounds = 2 if quick else 5
    segment = Segment.create("genie-bench", nbytes)
    try:
        out: dict = {"name": "host_copies", "mib": nbytes >> 20, "rounds": rounds}
        out.update(_host_rates(nbytes, rounds, segment))
        if torch.cuda.is_available():
            out.update(_gpu_rates(nbytes, rounds, segment))
        else:
            out["gpu"] = "none: the host's copy rates only"
    finally:
        segment.unlink()
    return out
