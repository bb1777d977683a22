"""Big byte copies on a few plain threads of this module's own, not on torch's.

On one host a client and its worker copy at the same time: the client fills a lent region while
the worker copies the last one to the GPU. torch's `copy_` runs on its OpenMP pool, whose threads
spin at each barrier; with a pool as wide as the machine in each process, each side's spinning
took the cores the other needed. On an H100 machine (16 cores) a 1 GiB upload in parts moved 2.0
GiB/s with 16 torch threads on each side and 12 with 8, and `model.to` of GPT-2 small took 0.45
to 0.54 s against 0.11 to 0.18 (benchmarks/RESULTS.md). Threads that sleep once their piece is done share the cores
instead: on this project's 2-core VM, two processes copying 32 MiB at once moved 3.0 GiB/s each
with torch's copy and 4.6 with these (one alone: 8.0 and 6.9).

THREADS is at most 8, inferred (not measured) to fill a host's memory bandwidth: one thread moved
8 GiB/s on that machine, torch's 16 moved 48. A copy is cut into at most THREADS pieces of at least
PIECE bytes (the last may be shorter; a task's hand-off costs tens of us), so one under 2 PIECE is
one memmove on the caller's thread.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ..threads import name_os_thread

THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
PIECE = 1 << 20
_move = ctypes.memmove  # (releases the GIL while it copies; the tests watch the pieces here)
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def copy(dst: int, src: int, n: int) -> None:
    """n bytes from address `src` to address `dst` (not overlapping), done when it returns; the
    caller's thread copies a piece too. The caller keeps both buffers alive."""
    pieces = min(THREADS, n // PIECE)
    if pieces <= 1:
        _move(dst, src, n)
        return
    step = (-(-n // pieces) + 4095) & ~4095  # (pieces start on a page)
    pool = _threads()
    futures: list[Future[Any]] = []
    try:
        for start in range(step, n, step):
            size = min(step, n - start)
            try:
                futures.append(pool.submit(_move, dst + start, src + start, size))
            except RuntimeError:  # (no new tasks at interpreter shutdown: this thread copies it)
                _move(dst + start, src + start, size)
        _move(dst, src, min(step, n))
    finally:
        _wait_all(futures)
    for future in futures:
        future.result()  # (a piece that failed: raised here, never a silent partial copy)


def _wait_all(futures: list[Future[Any]]) -> None:
    """Wait for every piece, even through an interrupt (raised once all are done): a piece still
    copying after `copy` returned could write into memory its caller has let go."""
    interrupted: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:  # (KeyboardInterrupt, or a cell's interrupt)
            interrupted = exc
    if interrupted is not None:
        raise interrupted


def copy_buffer(dst: Any, src: Any) -> None:
    """dst[:] = src for two buffers of the same length in bytes (src may be read-only)."""
    into, out_of = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    if into.nbytes != out_of.nbytes:
        raise ValueError(f"copying {out_of.nbytes} bytes into {into.nbytes}")
    if not into.flags.writeable:
        raise ValueError("copying into a read-only buffer")
    copy(into.ctypes.data, out_of.ctypes.data, into.nbytes)


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS - 1, thread_name_prefix="genie-copy", initializer=name_os_thread)
        return _pool


def _forked() -> None:  # (a child has none of its parent's threads)
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forked)
