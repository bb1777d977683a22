"""Upload segments a client lends to a worker that copies the bytes out (a GPU worker copies each
upload to the device), reused from one op batch to the next.

A segment made for each upload costs both sides fresh pages: the client faults in memory it fills
once, and the worker faults in its mapping as it reads (on an H100 machine, 0.55 s a GiB to make
and touch a segment; the worker's copy of an upload to the GPU took 0.12 to 0.51 s a GiB where the
same copy from warm memory took 0.025, the faults the likely cause: benchmarks/RESULTS.md). A
lent segment is made once, mapped once on each side, and its regions filled again once the batch
that named each is answered; its name goes at the worker's first mapping (as an adopted segment's
does), so nothing is left in /dev/shm whichever side dies.

Client side, `LentSegments`: each segment (a `SegmentRing`) is cut into regions in a ring, one for each
batch's uploads (`model.to` sends a batch per parameter). A region answered with no error and not
`kept` is free again; any other answer, or a lost connection, spoils its segment, retired once
nothing in it is out (its name goes in the next lent reference's `retired`, for the worker to
unmap). Once WORKING_BYTES of segments are made, an upload that finds no room waits (at most WAIT
seconds) for the worker to answer the oldest batch out rather than make more: a model moved in
lockstep with the worker's copies stays in memory already warm. Where a new segment would pass
`limit`, `take` returns None and the caller makes a one-off segment, adopted as before.

Worker side, `LentMaps`: the mappings by name, of one client (`lender`) at a time: a batch from
another (a client that reattached to the session) lets the last one's go. A batch's buffers are
views of a fresh array over the mapping; if anything still holds one once the batch is done (an
op kept a CPU argument, a fetch of an upload), the reply says `kept`, and the client retires that
segment (the mapping goes here with the name's retirement, its memory with the last view).
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ..protocol.contents import DataRef
from .segment import SHM_DIR, Segment

MIN_SIZE = 64 << 20  # a lent segment's smallest size; bigger ones are powers of two from here
WORKING_BYTES = 256 << 20  # of lent segments made before an upload waits for the worker instead
# seconds an upload waits for the worker to answer the oldest batch before making more (it waits
# holding the client's data-plane lock: another thread's transfer waits with it)
WAIT = 1.0
LIMIT = 2 << 30  # bytes a client keeps lent or ready for one worker, at most a quarter of /dev/shm
ALIGN = 4096  # regions start on a page
_taken = itertools.count()


class Answerable(Protocol):
    """What a region reads of the request that carries it (client/connection.py: Request)."""

    answer: dict[str, Any] | None
    lost: bool
    settled: threading.Event


def default_limit() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return min(LIMIT, st.f_blocks * st.f_frsize // 4)


class Region:
    """Bytes of a lent segment that one batch's uploads fill; out with `request` once sent."""

    def __init__(self, segment: Segment, offset: int, size: int) -> None:
        self.segment, self.offset, self.end = segment, offset, offset + size
        self.request: Answerable | None = None
        self.order = next(_taken)  # which was taken first, across segments

    @property
    def view(self) -> memoryview:
        return self.segment.view[self.offset : self.end]

    def settled(self) -> bool:
        """Answered, or lost with its connection (client/connection.py: Request)."""
        return self.request is not None and (self.request.answer is not None or self.request.lost)

    def reusable(self) -> bool:
        """Answered well, and the worker kept no view of it: its bytes may be written again."""
        answer = self.request.answer if self.request is not None else None
        return answer is not None and answer.get("status") == "ok" and not answer.get("kept")


class SegmentRing:
    """One lent segment cut into regions in a ring: taken in order, given back in order (a worker
    answers its batches in order). An upload starts at the segment's start whenever the regions out
    leave room there, so a segment reused in lockstep stays in the pages it warmed."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.regions: list[Region] = []  # out (taken or lent), oldest first

    def place(self, size: int) -> Region | None:
        """A region of `size` bytes (a multiple of ALIGN) where the ring has room, or None."""
        capacity = self.segment.size
        if not self.regions:
            offset: int | None = 0 if size <= capacity else None
        else:
            tail, head = self.regions[0].offset, self.regions[-1].end
            wrapped = self.regions[-1].offset < tail
            if wrapped:
                offset = head if tail - head >= size else None
            elif size <= tail:
                offset = 0
            else:
                offset = head if capacity - head >= size else None
        if offset is None:
            return None
        region = Region(self.segment, offset, size)
        self.regions.append(region)
        return region


class LentSegments:
    """A client's lent segments for one worker, and the regions of them out with requests."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = default_limit() if limit is None else limit
        self._rings: list[SegmentRing] = []  # oldest first
        self._spoiled: list[SegmentRing] = []  # answered with an error or a kept view: retired once all is settled
        self._retired: list[str] = []  # names to tell the worker it may unmap
        self._stalled: Answerable | None = None  # a request waited for in vain: not waited for again
        self.lender = os.urandom(6).hex()  # this pool, as the worker knows it (a reattached client's is new)
        self.made = 0  # segments made (a benchmark and the tests read it)
        self.waits = 0  # uploads that waited for the worker to give a region back

    def take(self, size: int) -> Region | None:
        """A region of at least `size` bytes: in a segment made before where one has room (waiting
        for the worker's answer to the oldest batch out, once WORKING_BYTES are made), else in a new
        one; None when a new one would pass the limit (the caller sends a one-off segment)."""
        size = -(-max(size, 1) // ALIGN) * ALIGN
        self._reclaim()
        region = self._place(size)
        past_working = self._held() + self._capacity(size) > min(WORKING_BYTES, self.limit)
        if region is None and past_working and self._wait_for_oldest():
            self._reclaim()
            region = self._place(size)
        return region if region is not None else self._new_ring(size)

    def ref(self, region: Region, sizes: list[int]) -> DataRef:
        """The reference a batch carries for a filled region (and the names retired since the last)."""
        ref = DataRef(segment=region.segment.name, sizes=sizes, lent=True, lender=self.lender, offset=region.offset)
        if self._retired:
            ref["retired"], self._retired = self._retired, []
        return ref

    def lend(self, ref: DataRef, request: Answerable) -> None:
        """The region `ref` names went out with `request`: free again once that is answered well."""
        region = self._find(ref)
        if region is not None and region.request is None:
            region.request = request

    def forget(self, ref: DataRef, *, sent: bool = True) -> None:
        """A taken region whose request failed. `sent=False`: it certainly did not go (its filling
        failed), and the region is free again. Else it may have: the worker may or may not map its
        segment, which is retired once nothing else in it is out. The names `ref` carried to retire
        are carried by the next. (A region not taken here, or lent already, is left alone.)"""
        region = self._find(ref)
        if region is None or region.request is not None:
            return
        self._retired.extend(ref.get("retired") or ())
        if not sent:
            for ring in self._rings:
                if region in ring.regions:
                    ring.regions.remove(region)  # (a gap inside the ring is not taken again before it turns)
            return
        region.request = _NOT_SENT
        self._reclaim()  # (its segment is spoiled now)

    def _find(self, ref: DataRef) -> Region | None:
        for ring in (*self._rings, *self._spoiled):
            if ring.segment.name == ref["segment"]:
                for region in ring.regions:
                    if region.offset == ref.get("offset", 0):
                        return region
        return None

    def _place(self, size: int) -> Region | None:
        for ring in self._rings:
            region = ring.place(size)
            if region is not None:
                return region
        return None

    def _capacity(self, size: int) -> int:
        """A new segment's size: MIN_SIZE at least, unless the limit is smaller (a small /dev/shm,
        such as a container's 64 MiB, gives a 16 MiB limit): then the upload's own power of two."""
        capacity = 1 << (max(size, 1) - 1).bit_length()
        return capacity if self.limit < MIN_SIZE else max(capacity, MIN_SIZE)

    def _new_ring(self, size: int) -> Region | None:
        capacity = self._capacity(size)
        if self._out() + capacity > self.limit:
            return None  # (no free one is retired for nothing)
        for ring in [r for r in self._rings if not r.regions]:
            if self._held() + capacity <= self.limit:
                break
            self._rings.remove(ring)  # the oldest free ones make room
            self._retire(ring)
        try:
            segment = Segment.create("genie-c", capacity)
        except OSError:  # /dev/shm is short of a power of two: a one-off segment of the size may fit
            return None
        self.made += 1
        ring = SegmentRing(segment)
        self._rings.append(ring)
        return ring.place(size)

    def _wait_for_oldest(self) -> bool:
        """Wait (at most WAIT seconds) for the oldest region out to be answered. True when one was
        (or already is: room may be free); False if there is none to wait for, or the worker did not
        answer in time (a busy worker: that request is not waited for again)."""
        first = [r for ring in self._rings for r in ring.regions[:1] if r.request is not None]
        if any(r.settled() for r in first):
            return True
        if not first:
            return False
        request = min(first, key=lambda r: r.order).request
        assert request is not None
        if request is self._stalled:
            return False
        self.waits += 1
        if not request.settled.wait(WAIT):
            self._stalled = request
            return False
        return True

    def _reclaim(self) -> None:
        for ring in list(self._rings):
            if any(r.settled() and not r.reusable() for r in ring.regions):
                self._spoil(ring)
                continue
            while ring.regions and ring.regions[0].reusable():
                ring.regions.pop(0)
        for ring in list(self._spoiled):
            if all(r.settled() for r in ring.regions):
                self._spoiled.remove(ring)
                self._retire(ring)

    def _spoil(self, ring: SegmentRing) -> None:
        if ring in self._rings:
            self._rings.remove(ring)
            self._spoiled.append(ring)

    def _out(self) -> int:
        """Bytes of segments with regions out (taken or lent): not to be retired to make room."""
        return sum(r.segment.size for r in (*self._rings, *self._spoiled) if r.regions)

    def _held(self) -> int:
        return sum(r.segment.size for r in (*self._rings, *self._spoiled))

    def _retire(self, ring: SegmentRing) -> None:
        ring.segment.close()
        ring.segment.unlink()  # (the worker removed the name at its first mapping; not if it never mapped it)
        self._retired.append(ring.segment.name)

    def close(self) -> None:
        for ring in (*self._rings, *self._spoiled):
            ring.segment.close()
            ring.segment.unlink()
        self._rings, self._spoiled, self._retired = [], [], []


class _NotSent:
    """The request of a region whose batch may not have gone: settled, not reusable."""

    answer: dict[str, Any] | None = None
    lost = True
    settled = threading.Event()


_NOT_SENT = _NotSent()


class LentMaps:
    """A worker's mappings of the segments its client lends, by name."""

    def __init__(self) -> None:
        self._maps: dict[str, Segment] = {}
        self._lender = ""  # whose they are: a session has one client at a time

    def buffers(self, ref: DataRef) -> tuple[list[memoryview], Callable[[], bool]]:
        """The batch's buffers (views of a fresh array over the mapping, made on first use), and a
        test to call once the batch is done and its buffers dropped: whether anything still views
        them (then the reply must say `kept`, and the client retires the segment)."""
        import numpy as np

        lender = ref.get("lender", "")
        if lender != self._lender:  # a client that reattached: the last one's are gone
            self.close()
            self._lender = lender
        for name in ref.get("retired") or ():
            self._let_go(str(name))
        name, offset = str(ref["segment"]), int(ref.get("offset", 0))
        segment = self._maps.get(name)
        if segment is None:
            segment = self._maps[name] = Segment.attach(name)
            segment.unlink()  # both sides hold it mapped: no name needed from here
        if offset < 0 or offset + sum(int(n) for n in ref["sizes"]) > segment.size:
            raise ValueError(f"a lent region past the end of {name} ({segment.size} bytes)")
        array = np.frombuffer(segment.map, dtype=np.uint8)
        out = []
        for n in (int(size) for size in ref["sizes"]):
            out.append(array[offset : offset + n].data)
            offset += n
        viewed = weakref.ref(array)
        del array

        def kept() -> bool:  # (other batches out may name other regions of it: mapped until retired)
            return viewed() is not None

        return out, kept

    def _let_go(self, name: str) -> None:
        segment = self._maps.pop(name, None)
        if segment is not None:
            segment.close()

    def close(self) -> None:
        for name in list(self._maps):
            self._let_go(name)
