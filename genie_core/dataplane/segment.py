"""Shared-memory segments in /dev/shm that client, server and worker on one host can all map.

Plain files under /dev/shm with mode 0600 (no resource tracker to fight over who unlinks),
reused while big enough: fresh large allocations are slow, reused mappings are not.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..threads import name_os_thread
from . import memcopy

log = logging.getLogger("genie.data")

SHM_DIR = Path("/dev/shm")
REFILL_WAIT = 5.0  # seconds a buffer is waited for while a refill of its size is under way (then made anew)
SENT = ".sent"  # added to a staged segment's name once its data port has sent it: its worker may refill it


def shm_available() -> tuple[bool, str]:
    if not SHM_DIR.is_dir():
        return False, "no /dev/shm on this machine"
    if not os.access(SHM_DIR, os.W_OK):
        return False, "/dev/shm is not writable"
    return True, ""


def segment_name(prefix: str) -> str:
    """A fresh name that says which process made it (`creator_pid`): `prefix-PID-RANDOM`,
    where `prefix` is `genie-` and one word."""
    return f"{prefix}-{os.getpid()}-{os.urandom(6).hex()}"


def creator_pid(name: str) -> int | None:
    """The pid in a name made by `segment_name`, or None for a name it did not make."""
    parts = name.split("-")
    return int(parts[2]) if len(parts) == 4 and parts[0] == "genie" and parts[2].isdigit() else None


class Segment:
    def __init__(self, name: str, size: int, create: bool, allocate: bool = False) -> None:
        """`allocate`: give a new segment its pages now (_allocate), for one made ahead of its use."""
        self.name = name
        self.path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                st = os.statvfs(SHM_DIR)
                if size > st.f_bavail * st.f_frsize:  # a full tmpfs would SIGBUS us later: refuse now
                    raise _no_room(size)
                os.ftruncate(fd, max(size, 1))
                if allocate:
                    _allocate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.map = mmap.mmap(fd, max(size, 1))
        except BaseException:  # (interrupted too): a segment made here is not left behind
            if create:
                self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.view = memoryview(self.map)

    @classmethod
    def create(cls, prefix: str, size: int, allocate: bool = False) -> Segment:
        return cls(segment_name(prefix), size, create=True, allocate=allocate)

    @classmethod
    def attach(cls, name: str) -> Segment:
        if "/" in name or not name.startswith("genie-"):
            raise ValueError(f"not a genie segment name: {name!r}")
        return cls(name, 0, create=False)

    @classmethod
    def adopt(cls, name: str) -> memoryview:
        """Map a segment and remove its name: the memory is ours for as long as anything views it
        (tensors made from it included), and is freed when the last view goes. No copy."""
        segment = cls.attach(name)
        segment.unlink()
        return segment.view

    @staticmethod
    def send_back(name: str) -> None:
        """A data port has sent this staged segment: its worker may fill it again (`taken_back`)."""
        if "/" in name or not name.startswith("genie-w-"):
            return
        with contextlib.suppress(OSError):  # (the worker has moved on and removed it)
            os.rename(SHM_DIR / name, SHM_DIR / (name + SENT))

    def taken_back(self) -> bool:
        """Whether a data port has sent this segment, which it was staged for (`send_back`); it is
        ours again, under its own name."""
        try:
            os.rename(SHM_DIR / (self.name + SENT), self.path)
        except OSError:
            return False
        return True

    @staticmethod
    def discard(name: str) -> None:
        """Remove a segment nobody will adopt (a transfer that failed or was refused)."""
        if "/" not in name and name.startswith("genie-"):
            (SHM_DIR / name).unlink(missing_ok=True)

    def close(self) -> None:
        try:
            self.view.release()
            self.map.close()
        except (BufferError, ValueError):
            pass  # something still views it; the mapping goes when that does

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
        (SHM_DIR / (self.name + SENT)).unlink(missing_ok=True)


ALLOCATE_MIN = 1 << 20  # bytes: a spare segment from this size up gets its pages at creation, all at once


def _no_room(size: int) -> OSError:
    return OSError(errno.ENOSPC, f"not enough shared memory for {size} bytes in {SHM_DIR}")


def _allocate(fd: int, size: int) -> None:
    """Give a new segment its pages now, in one call, which tmpfs does in bulk for less than faulting
    them in one by one (benchmarks/RESULTS.md, across_hosts); a full /dev/shm then fails here, not
    as a SIGBUS at a first write. For a spare, made ahead: a segment filled at once is faulted in
    by the copy's threads in parallel, which measured faster. Skipped where the filesystem cannot."""
    if size < ALLOCATE_MIN:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_room(size) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


MADV_POPULATE_WRITE = 23  # Linux 5.14 on (mmap.MADV_POPULATE_WRITE from Python 3.13): map every page now
_PAGE = mmap.PAGESIZE
_libc: Any = None


def touch(view: memoryview) -> None:
    """Fault every page in now, so a transfer later need not: in one call where the kernel can
    (`MADV_POPULATE_WRITE`, Linux), else one write per page. Its contents are not kept."""
    import numpy as np

    if not len(view):
        return
    array = np.frombuffer(view, dtype=np.uint8)
    start = array.ctypes.data
    first = -start % _PAGE  # madvise wants a page-aligned start
    whole = (len(view) - first) // _PAGE * _PAGE
    if whole > 0 and _populate(start + first, whole):
        array[:first] = 0
        array[first + whole :] = 0
        return
    array[::_PAGE] = 0
    array[-1] = 0  # (the last page, where the buffer does not start on a page)


def _populate(address: int, length: int) -> bool:
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return bool(_libc.madvise(address, length, MADV_POPULATE_WRITE) == 0)  # (EINVAL before Linux 5.14)


class Spares:
    """One ready buffer of the size last asked for, made and faulted in on a background thread:
    fresh memory is slow to touch (page faults), so repeated transfers of a size find it warm."""

    def __init__(
        self,
        make: Callable[[int], Any],
        release: Callable[[Any], None],
        view: Callable[[Any], memoryview],
        cap: int = 1 << 30,
        make_ahead: Callable[[int], Any] | None = None,
    ) -> None:
        """`make_ahead`: how a refill makes its buffer, where that differs from a buffer made for a
        transfer that needs it now (`make`)."""
        self._make, self._release, self._view, self._cap = make, release, view, cap
        self._make_ahead = make_ahead or make
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # a refill finished (or the spares closed)
        self._spare: Any = None
        self._size = -1
        self._closed = False
        self._refills: list[threading.Thread] = []  # under way: close waits for them
        self._coming: Counter[int] = Counter()  # the sizes of the refills under way

    def take(self, size: int, refill: bool = True) -> Any:
        """A buffer of `size` bytes; with `refill=False`, call `refill(size)` once the transfer is
        done, so faulting in the next spare does not compete with this transfer for the CPU. A
        refill of this size under way is waited for (up to REFILL_WAIT): making another buffer
        beside it would fault in twice the memory at once."""

        def ready() -> bool:
            return self._closed or (self._spare is not None and self._size == size) or not self._coming[size]

        with self._lock:
            self._landed.wait_for(ready, REFILL_WAIT)
            spare, self._spare = (self._spare, None) if self._size == size else (None, self._spare)
            stale = None if spare is not None or self._spare is None else self._spare
            if stale is not None:
                self._spare = None
        if stale is not None:
            self._release(stale)
        if spare is None:
            spare = self._make(size)
        if refill:
            self.refill(size)
        return spare

    def refill(self, size: int) -> None:
        if 0 < size <= self._cap and not self._closed:
            thread = threading.Thread(target=self._refill, args=(size,), daemon=True, name="genie-spare")
            with self._lock:
                self._refills = [t for t in self._refills if t.is_alive()] + [thread]
                self._coming[size] += 1
            try:
                thread.start()
            except BaseException:
                self._arrived(size, None)
                raise

    def _refill(self, size: int) -> None:
        name_os_thread()
        fresh = None
        try:
            fresh = self._make_ahead(size)
            touch(self._view(fresh))
        except Exception as exc:  # (a spare is a head start: the next transfer makes its own, or says why not)
            log.warning("a spare buffer of %d bytes could not be made: %s", size, exc)
        finally:
            self._arrived(size, fresh)

    def _arrived(self, size: int, fresh: Any) -> None:
        """A refill is over: its buffer becomes the spare (the size last asked for), unless the
        spares closed or one of that size is there."""
        with self._lock:
            self._coming[size] -= 1
            if fresh is None or self._closed or (self._spare is not None and self._size == size):
                old = fresh
            else:
                old, self._spare, self._size = self._spare, fresh, size
            self._landed.notify_all()
        if old is not None:
            self._release(old)

    def close(self, wait: float = 10.0) -> None:
        """Release the spare, and wait (up to `wait` seconds) for refills under way to release
        theirs: a process that exits meanwhile would kill them between making a segment and
        removing it."""
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
            refills, self._refills = self._refills, []
            self._landed.notify_all()
        if spare is not None:
            self._release(spare)
        deadline = time.monotonic() + wait
        for thread in refills:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


def segment_spares(prefix: str) -> Spares:
    def release(segment: Segment) -> None:
        segment.close()
        segment.unlink()

    return Spares(
        lambda size: Segment.create(prefix, size),
        release,
        lambda segment: segment.view,
        make_ahead=lambda size: Segment.create(prefix, size, allocate=True),
    )


def memory_spares() -> Spares:
    """Spare receive buffers in this process's own memory (a socket backend's destination)."""
    import numpy as np

    return Spares(lambda size: np.empty(size, dtype=np.uint8).data, lambda buffer: None, lambda buffer: buffer)


def sweep_worker(pid: int) -> None:
    """Remove what a dead worker staged and nobody collected."""
    for path in SHM_DIR.glob(f"genie-w-{pid}-*"):
        path.unlink(missing_ok=True)


def sweep_dead() -> int:
    """Remove genie segments whose creating process is gone (it was killed before cleaning up)."""
    removed = 0
    if not SHM_DIR.is_dir():
        return 0
    for path in SHM_DIR.glob("genie-*"):
        pid = creator_pid(path.name)
        if pid is None:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:  # a sandboxed worker's private /dev/shm is a folder (genie-sbx-PID-ID)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
        except PermissionError:
            pass
    return removed


THREADED_COPY_MIN = 1 << 20  # bytes: from here copies go to memcopy (on its threads from 2 PIECE)


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src (bytes, same length); a big copy on memcopy's threads. A memoryview copy is one
    thread: 8 GiB/s on a 16-core GPU machine, where 16 threads moved 48 (benchmarks/RESULTS.md)."""
    if len(src) < THREADED_COPY_MIN:
        dst[:] = src
        return
    memcopy.copy_buffer(dst, src)


class LateBuffer:
    """Bytes not in host memory yet (a GPU tensor's): written straight into the memory they are
    sent from (a staging segment), instead of into memory of their own and then copied there."""

    nbytes: int

    def write_into(self, dst: memoryview, progress: Callable[[int], None] | None = None) -> None:
        """All `nbytes` into `dst` (as long), `progress(done)` as parts of it land."""
        raise NotImplementedError

    def host(self) -> memoryview:
        """The bytes in memory of their own: for a message that carries them inline."""
        import numpy as np

        out = np.empty(self.nbytes, dtype=np.uint8)
        self.write_into(out.data)
        return out.data


def buffer_size(b: Any) -> int:
    return b.nbytes if isinstance(b, LateBuffer) else memoryview(b).nbytes


def pack_into(view: memoryview, buffers: list[Any], progress: Any = None, chunk: int = 64 << 20) -> list[int]:
    """Copy buffers back to back into `view` (a LateBuffer writes itself there); return their sizes."""
    sizes, offset = [], 0
    total = sum(buffer_size(b) for b in buffers)

    def from_(at: int) -> Callable[[int], None] | None:
        return None if progress is None else lambda done: progress(at + done, total)

    for b in buffers:
        if isinstance(b, LateBuffer):
            b.write_into(view[offset : offset + b.nbytes], from_(offset))
            offset += b.nbytes
            sizes.append(b.nbytes)
            continue
        m = memoryview(b).cast("B")
        for start in range(0, m.nbytes, chunk):
            piece = m[start : start + chunk]
            copy_bytes(view[offset : offset + len(piece)], piece)
            offset += len(piece)
            if progress is not None:
                progress(offset, total)
        sizes.append(m.nbytes)
    return sizes


def split(view: memoryview, sizes: list[int]) -> list[memoryview]:
    """Views of consecutive buffers in `view` (no copies)."""
    out, offset = [], 0
    for n in sizes:
        out.append(view[offset : offset + n])
        offset += n
    return out
