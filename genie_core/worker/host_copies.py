"""Copies between host memory and a CUDA GPU at the speed of pinned memory.

Uploaded bytes arrive in a shared segment and fetched ones leave through one: pageable memory,
which CUDA copies synchronously through small staging buffers of its own (on an H100 machine,
9.2 GiB/s to the GPU and 1.5 back, where this module's ring moved 41 and 10.7: benchmarks/RESULTS.md).
Three ways, chosen by GENIE_HOST_COPIES (benchmarks/host_copies.py compares them):
- "ring" (the default): a ring of pinned staging buffers; one is filled (a host copy) while the
  copy engine moves another, on a copy stream of its own, so host copies and DMA overlap;
- "register": the host memory page-locked where it lies (cudaHostRegister) for the copy, then
  unlocked (one DMA and no host copy, but locking costs 32 ms a GiB);
- "pageable": PyTorch's own `.to()` and `.cpu()`.
Tensors under RING_MIN bytes take PyTorch's own copy (the ring loses below 1 MiB); CHUNK is 16 MiB,
86% of 64 MiB buffers' rate for a quarter of the page-locked memory (32 MiB a worker).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ..dataplane import memcopy
from ..dataplane.segment import LateBuffer
from ..serialize import serialize, tensor_meta

CHUNK = 16 << 20  # bytes per staging buffer
SLOTS = 2
RING_MIN = 1 << 20
WAYS = ("ring", "register", "pageable")


def way() -> str:
    """The way chosen for this process (GENIE_HOST_COPIES), read at each copy so a benchmark can
    switch it; a name that is not a way is an error, never a silent default."""
    chosen = os.environ.get("GENIE_HOST_COPIES", "ring")
    if chosen not in WAYS:
        raise ValueError(f"GENIE_HOST_COPIES={chosen!r}: expected one of {', '.join(WAYS)}")
    return chosen


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes a contiguous or dense tensor covers, as a flat uint8 tensor on its device (no copy)."""
    start = int(t.storage_offset()) * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), start, (t.nbytes,), (1,))


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
    copy engine's last use of buffer i (the host waits on it before filling the buffer again). The
    host copies go on memcopy's threads, not torch's: the client copies the next upload on its own
    at the same time (dataplane/memcopy.py)."""

    def __init__(self, device: torch.device, chunk: int = CHUNK, slots: int = SLOTS) -> None:
        self.device = device
        self.chunk = chunk
        self.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # (untyped in torch)
        self.slot_ready = [torch.cuda.Event() for _ in range(slots)]  # type: ignore[no-untyped-call]

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Host bytes `src` into device bytes `dst` (flat uint8, same size). Returns once `src` has
        been read; the device's current stream waits for the copies (nothing else does)."""
        _check_bytes(src, dst, host=src)
        stream, n, slots = self.stream, src.numel(), len(self.buffers)
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)  # (dst was allocated there)
        try:
            for i, start in enumerate(range(0, n, self.chunk)):
                slot, size = i % slots, min(self.chunk, n - start)
                self.slot_ready[slot].synchronize()
                staged = self.buffers[slot][:size]
                memcopy.copy(staged.data_ptr(), src.data_ptr() + start, size)
                with torch.cuda.stream(stream):
                    dst[start : start + size].copy_(staged, non_blocking=True)
                    self.slot_ready[slot].record(stream)
        finally:  # (also when a copy fails: dst's memory is not reused while copies into it are queued)
            current.wait_stream(stream)

    def download(self, src: torch.Tensor, dst: torch.Tensor, progress: Callable[[int], None] | None = None) -> None:
        """Device bytes `src` into host bytes `dst` (flat uint8, same size), done when it returns,
        `progress(done)` after each chunk. The copy engine fills one buffer while the host empties
        another."""
        _check_bytes(src, dst, host=dst)
        stream, n, slots = self.stream, src.numel(), len(self.buffers)
        pieces = [(i % slots, start, min(self.chunk, n - start)) for i, start in enumerate(range(0, n, self.chunk))]
        stream.wait_stream(torch.cuda.current_stream(self.device))

        def issue(slot: int, start: int, size: int) -> None:
            with torch.cuda.stream(stream):
                self.buffers[slot][:size].copy_(src[start : start + size], non_blocking=True)
                self.slot_ready[slot].record(stream)

        for piece in pieces[:slots]:
            issue(*piece)
        for i, (slot, start, size) in enumerate(pieces):
            self.slot_ready[slot].synchronize()
            memcopy.copy(dst.data_ptr() + start, self.buffers[slot].data_ptr(), size)
            if i + slots < len(pieces):
                issue(*pieces[i + slots])
            if progress is not None:
                progress(start + size)


def _check_bytes(src: torch.Tensor, dst: torch.Tensor, host: torch.Tensor) -> None:
    """The ring copies host bytes by address: both sides flat contiguous uint8 of one length, the
    host side in CPU memory (else a copy could run past a buffer)."""
    if any(t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous() for t in (src, dst)):
        raise ValueError("the pinned ring copies flat contiguous uint8 tensors only")
    if src.numel() != dst.numel() or host.device.type != "cpu":
        raise ValueError(
            f"the pinned ring cannot copy {src.numel()} bytes on {src.device} into {dst.numel()} on {dst.device}"
        )


_rings: dict[torch.device, PinnedRing] = {}


def _ring(device: torch.device) -> PinnedRing:
    ring = _rings.get(device)
    if ring is None:
        ring = _rings[device] = PinnedRing(device)
    return ring


@contextmanager
def _locked(host: torch.Tensor) -> Iterator[None]:
    """`host`'s bytes page-locked where they lie (cudaHostRegister) for one copy on the current
    stream, which is waited for before they are unlocked."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # (untyped in torch)
    pointer, size = host.data_ptr(), host.numel()
    status = cudart.cudaHostRegister(pointer, size, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed: CUDA error {int(status)}")
    try:
        yield
        torch.cuda.current_stream().synchronize()
    finally:
        cudart.cudaHostUnregister(pointer)


def _copy(src: torch.Tensor, dst: torch.Tensor, device: torch.device, chosen: str) -> None:
    """Bytes to bytes (flat uint8, one of them on `device`), the chosen way; done for the host when
    it returns."""
    uploading = src.device.type == "cpu"
    if chosen == "ring":
        if uploading:
            _ring(device).upload(src, dst)
        else:
            _ring(device).download(src, dst)
        return
    with torch.cuda.device(device), _locked(src if uploading else dst):
        dst.copy_(src, non_blocking=True)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor's copy on `device`, laid out the same (an upload: dense, at offset 0, its conj
    and neg bits resolved and detached by HostTensor)."""
    if device.type != "cuda" or host.nbytes < RING_MIN or not _dense(host):
        return host.to(device)
    chosen = way()
    if chosen == "pageable":
        return host.to(device)
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    _copy(_bytes(host), _bytes(out), device, chosen)
    return out


def bytes_into(host: torch.Tensor, out: torch.Tensor, start: int) -> None:
    """Host bytes (flat uint8) into `out`'s bytes from `start` on (`out` dense, at offset 0): a part
    of a big upload. Done with `host` when it returns."""
    dst = _bytes(out)[start : start + host.numel()]
    chosen = way() if out.device.type == "cuda" and host.numel() >= RING_MIN else "pageable"
    if chosen == "pageable":
        dst.copy_(host)
        return
    _copy(host, dst, out.device, chosen)


class DeviceBytes(LateBuffer):
    """A GPU tensor's bytes as a fetch sends them (C order), copied to the host only into the memory
    they are sent from: a staging segment, which the client adopts or a data port sends from (one
    host copy, where a host tensor of their own and then the segment took two, and fresh memory's
    page faults)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.nbytes = t.nbytes

    def write_into(self, dst: memoryview, progress: Callable[[int], None] | None = None) -> None:
        src = self.tensor.resolve_conj().resolve_neg()
        if not src.is_contiguous():
            src = src.contiguous()  # (on the GPU, only now: one such copy at a time, for one fetch)
        host, raw, chosen = torch.frombuffer(dst, dtype=torch.uint8), _bytes(src), way()
        if chosen == "ring":
            _ring(src.device).download(raw, host, progress)
            return
        if chosen == "pageable":
            host.copy_(raw)
        else:
            _copy(raw, host, src.device, chosen)
        if progress is not None:
            progress(self.nbytes)


class HostTensorBytes(LateBuffer):
    """A CPU tensor's bytes as a fetch sends them (C order), copied from its memory only where they
    are sent from: a staging segment, or memory of their own for a message. Never a NumPy view of
    its memory, as serialize.serialize gives: PyTorch then refuses to resize that storage for good
    (a fetched tensor could not grow: `x.cpu(); x.resize_(n)` failed on a CPU server)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()
        self.nbytes = t.nbytes

    def write_into(self, dst: memoryview, progress: Callable[[int], None] | None = None) -> None:
        src = self.tensor.resolve_conj().resolve_neg().contiguous()
        into, start = np.frombuffer(dst, dtype=np.uint8).ctypes.data, src.data_ptr()
        for done in range(0, self.nbytes, CHUNK):  # (in parts: a streamed fetch sends each as it lands)
            n = min(CHUNK, self.nbytes - done)
            memcopy.copy(into + done, start + done, n)  # (src alive till it returns)
            if progress is not None:
                progress(done + n)


def serialized(value: Any) -> tuple[dict[str, Any], list[Any]]:
    """What a fetch or pull sends of a value (serialize.serialize's description and buffers): a
    big GPU tensor's bytes left on the GPU until they are written where they are sent
    (DeviceBytes), a CPU tensor's copied from its memory there (HostTensorBytes). A subclass,
    nested or sparse tensor, and a small GPU tensor, keep their own `.cpu()`."""
    if isinstance(value, torch.Tensor) and _plain(value) and value.nbytes:
        if value.device.type == "cuda" and value.nbytes >= RING_MIN:
            return tensor_meta(value), [DeviceBytes(value)]
        if value.device.type == "cpu":
            return tensor_meta(value), [HostTensorBytes(value)]
    return serialize(value)


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_nested
