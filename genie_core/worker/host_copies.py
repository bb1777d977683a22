"""Copies between host memory and a CUDA GPU at the speed of pinned memory.

Uploaded bytes arrive in a shared segment and fetched ones leave through one: pageable memory,
which CUDA copies synchronously through small staging buffers of its own. On an H100 machine
(benchmarks/RESULTS.md, 1 GiB): pageable 9.2 GiB/s to the GPU and 1.5 back; this module's ring
41 and 10.7 (48 and 11.2 with 64 MiB buffers); the segment page-locked for each copy 14.8 and 2.9.
Three ways, chosen by GENIE_HOST_COPIES (benchmarks/host_copies.py compares them):
- "ring" (the default): a ring of pinned staging buffers; one is filled (a host copy) while the
  copy engine moves another, on a copy stream of its own, so host copies and DMA overlap;
- "register": the host memory page-locked where it lies (cudaHostRegister) for the copy, then
  unlocked (one DMA and no host copy, but locking costs 32 ms a GiB);
- "pageable": PyTorch's own `.to()` and `.cpu()`.
Tensors under RING_MIN bytes take PyTorch's own copy: the ring loses below 1 MiB (1.3x pageable's
time up, 2x down, at 256 KiB). CHUNK is 16 MiB: 86% of 64 MiB buffers' rate for a quarter of the
page-locked memory (32 MiB a worker).
"""

from __future__ import annotations

import os
from typing import Any

import torch

CHUNK = 16 << 20  # bytes per staging buffer
SLOTS = 2
RING_MIN = 1 << 20
WAYS = ("ring", "register", "pageable")


def way() -> str:
    chosen = os.environ.get("GENIE_HOST_COPIES", "ring")
    if chosen not in WAYS:
        raise ValueError(f"GENIE_HOST_COPIES={chosen!r}: expected one of {', '.join(WAYS)}")
    return chosen


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a dense tensor's whole storage, as a flat uint8 tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its whole storage, each byte once (contiguous or a permutation of it)."""
    if t.storage_offset() or t.untyped_storage().nbytes() != t.nbytes:
        return False
    expected = 1  # each dim's stride, smallest first, the product of the sizes before it
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class PinnedRing:
    """SLOTS pinned buffers of `chunk` bytes and a copy stream; `slot_ready[i]` is recorded after the
    copy engine's last use of buffer i (the host waits on it before filling the buffer again)."""

    def __init__(self, device: torch.device, chunk: int = CHUNK, slots: int = SLOTS) -> None:
        self.device = device
        self.chunk = chunk
        self.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # (untyped in torch)
        self.slot_ready = [torch.cuda.Event() for _ in range(slots)]  # type: ignore[no-untyped-call]

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Host bytes `src` into device bytes `dst` (flat uint8, same size). Returns once `src` has
        been read; the device's current stream waits for the copies (nothing else does)."""
        stream, n, slots = self.stream, src.numel(), len(self.buffers)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # (dst was allocated there)
        for i, start in enumerate(range(0, n, self.chunk)):
            slot, size = i % slots, min(self.chunk, n - start)
            self.slot_ready[slot].synchronize()
            staged = self.buffers[slot][:size]
            staged.copy_(src[start : start + size])
            with torch.cuda.stream(stream):
                dst[start : start + size].copy_(staged, non_blocking=True)
                self.slot_ready[slot].record(stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def download(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Device bytes `src` into host bytes `dst` (flat uint8, same size), done when it returns.
        The copy engine fills one buffer while the host empties another."""
        stream, n, slots = self.stream, src.numel(), len(self.buffers)
        starts = list(range(0, n, self.chunk))
        stream.wait_stream(torch.cuda.current_stream(self.device))

        def issue(i: int) -> None:
            slot, start = i % slots, starts[i]
            size = min(self.chunk, n - start)
            with torch.cuda.stream(stream):
                self.buffers[slot][:size].copy_(src[start : start + size], non_blocking=True)
                self.slot_ready[slot].record(stream)

        for i in range(min(slots, len(starts))):
            issue(i)
        for i, start in enumerate(starts):
            slot, size = i % slots, min(self.chunk, n - start)
            self.slot_ready[slot].synchronize()
            dst[start : start + size].copy_(self.buffers[slot][:size])
            if i + slots < len(starts):
                issue(i + slots)


_rings: dict[torch.device, PinnedRing] = {}


def _ring(device: torch.device) -> PinnedRing:
    ring = _rings.get(device)
    if ring is None:
        ring = _rings[device] = PinnedRing(device)
    return ring


def _registered(host: torch.Tensor) -> Any:
    """Page-lock `host`'s bytes where they lie, for one copy; returns what unlocks them."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # (untyped in torch)
    pointer, size = host.data_ptr(), host.numel()
    status = cudart.cudaHostRegister(pointer, size, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed: CUDA error {int(status)}")
    return lambda: cudart.cudaHostUnregister(pointer)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor's copy on `device`, laid out the same (an upload: dense, at offset 0)."""
    chosen = way()
    if device.type != "cuda" or chosen == "pageable" or host.nbytes < RING_MIN or not _dense(host):
        return host.to(device)
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    src, dst = _bytes(host), _bytes(out)
    if chosen == "ring":
        _ring(device).upload(src, dst)
        return out
    unlock = _registered(src)
    try:
        dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
    finally:
        unlock()
    return out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's values in fresh host memory (contiguous): what a fetch sends."""
    chosen = way()
    if t.device.type != "cuda" or chosen == "pageable" or t.nbytes < RING_MIN:
        return t.cpu()
    src = t.detach().resolve_conj().resolve_neg()
    if not (_dense(src) and src.is_contiguous()):  # (a contiguous view of part of a storage too)
        src = src.clone(memory_format=torch.contiguous_format)
    out = torch.empty(src.shape, dtype=src.dtype)
    dst = _bytes(out)
    if chosen == "ring":
        _ring(t.device).download(_bytes(src), dst)
    else:
        unlock = _registered(dst)
        try:
            dst.copy_(_bytes(src), non_blocking=True)
            torch.cuda.current_stream(t.device).synchronize()
        finally:
            unlock()
    return out.requires_grad_(t.requires_grad)
