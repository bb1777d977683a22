"""Upload segments a client lends to a worker that copies the bytes out (a GPU worker copies each
upload to the device), reused from one op batch to the next.

A segment made for each upload costs both sides fresh pages: the client faults in memory it fills
once, and the worker faults in its mapping as it reads (on an H100 machine, 0.55 s a GiB to make
and touch a segment; the worker's copy of an upload to the GPU took 0.12 to 0.51 s a GiB where the
same copy from warm memory took 0.025, the faults the likely cause: benchmarks/RESULTS.md). A
lent segment is made once, mapped once on each side, and filled
again once the batch that named it is answered; its name goes at the worker's first mapping (as an
adopted segment's does), so nothing is left in /dev/shm whichever side dies.

Client side, `LentSegments`: a segment whose batch was answered with no error and not `kept` is
filled again; any other answer, or a lost connection, retires it (its name goes in the next lent
reference's `retired`, for the worker to unmap). When every segment is out on loan and a new one
would pass `limit`, `take` returns None and the caller makes a one-off segment, adopted as before.

Worker side, `LentMaps`: the mappings by name, of one client (`lender`) at a time: a batch from
another (a client that reattached to the session) lets the last one's go. A batch's buffers are
views of a fresh array over the mapping; if anything still holds one once the batch is done (an
op kept a CPU argument, a fetch of an upload), the reply says `kept` and the worker lets that
mapping go with its views.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

from ..protocol.contents import DataRef
from .segment import SHM_DIR, Segment

MIN_SIZE = 1 << 20  # a lent segment's smallest size; sizes are powers of two from here
LIMIT = 2 << 30  # bytes a client keeps lent or ready for one worker, at most a quarter of /dev/shm


def default_limit() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return min(LIMIT, st.f_blocks * st.f_frsize // 4)


class LentSegments:
    """A client's lent segments: free ones, and ones out with the request that named them."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = default_limit() if limit is None else limit
        self._free: list[Segment] = []
        self._lent: list[tuple[Segment, Any]] = []  # (segment, the request that carries its name)
        self._unsent: list[Segment] = []  # taken, not yet lent to a request
        self._retired: list[str] = []  # names to tell the worker it may unmap
        self.lender = os.urandom(6).hex()  # this pool, as the worker knows it (a reattached client's is new)
        self.made = 0  # segments made (a benchmark and the tests read it)

    def take(self, size: int) -> Segment | None:
        """A segment of at least `size` bytes, warm if one is free; None when none fits the limit."""
        self._reclaim()
        fits = [s for s in self._free if size <= s.size <= 4 * max(size, MIN_SIZE)]
        if fits:
            segment = min(fits, key=lambda s: s.size)
            self._free.remove(segment)
        else:
            capacity = max(MIN_SIZE, 1 << (size - 1).bit_length())
            if self._out() + capacity > self.limit:
                return None  # (no free one is retired for nothing)
            while self._free and self._held() + capacity > self.limit:
                self._retire(self._free.pop(0))  # the oldest free one makes room
            try:
                segment = Segment.create("genie-c", capacity)
            except OSError:  # /dev/shm is short of a power of two: a one-off segment of the size may fit
                return None
            self.made += 1
        self._unsent.append(segment)
        return segment

    def ref(self, segment: Segment, sizes: list[int]) -> DataRef:
        """The reference a batch carries for a filled segment (and the names retired since the last)."""
        ref = DataRef(segment=segment.name, sizes=sizes, lent=True, lender=self.lender)
        if self._retired:
            ref["retired"], self._retired = self._retired, []
        return ref

    def lend(self, name: str, request: Any) -> None:
        """The segment named `name` went out with `request`: free again once it is answered."""
        segment = self._pop_unsent(name)
        if segment is not None:
            self._lent.append((segment, request))

    def forget(self, ref: DataRef) -> None:
        """A taken segment whose request was not sent, or may not have been (its filling or sending
        failed): retired, as the worker may or may not have mapped it; the names `ref` carried to
        retire are carried by the next. (One not taken from here, or lent already, is left alone.)"""
        segment = self._pop_unsent(ref["segment"])
        if segment is not None:
            self._retired.extend(ref.get("retired") or ())
            self._retire(segment)

    def _pop_unsent(self, name: str) -> Segment | None:
        for segment in self._unsent:
            if segment.name == name:
                self._unsent.remove(segment)
                return segment
        return None

    def _reclaim(self) -> None:
        still = []
        for segment, request in self._lent:
            answer = request.answer  # (client/connection.py: Request)
            if answer is not None:
                if answer.get("status") == "ok" and not answer.get("kept"):
                    self._free.append(segment)
                else:
                    self._retire(segment)
            elif request.lost:
                self._retire(segment)
            else:
                still.append((segment, request))
        self._lent = still

    def _out(self) -> int:
        """Bytes taken or lent: not to be retired to make room."""
        return sum(s.size for s in self._unsent) + sum(s.size for s, _ in self._lent)

    def _held(self) -> int:
        return sum(s.size for s in self._free) + self._out()

    def _retire(self, segment: Segment) -> None:
        segment.close()
        segment.unlink()  # (the worker removed the name at its first mapping; not if it never mapped it)
        self._retired.append(segment.name)

    def close(self) -> None:
        for segment in [*self._free, *self._unsent, *(s for s, _ in self._lent)]:
            segment.close()
            segment.unlink()
        self._free, self._unsent, self._lent, self._retired = [], [], [], []


class LentMaps:
    """A worker's mappings of the segments its client lends, by name."""

    def __init__(self) -> None:
        self._maps: dict[str, Segment] = {}
        self._lender = ""  # whose they are: a session has one client at a time

    def buffers(self, ref: DataRef) -> tuple[list[memoryview], Callable[[], bool]]:
        """The batch's buffers (views of a fresh array over the mapping, made on first use), and a
        test to call once the batch is done and its buffers dropped: whether anything still views
        them (then the mapping is let go here, and the reply must say `kept`)."""
        import numpy as np

        lender = ref.get("lender", "")
        if lender != self._lender:  # a client that reattached: the last one's are gone
            self.close()
            self._lender = lender
        for name in ref.get("retired") or ():
            self._let_go(str(name))
        name = str(ref["segment"])
        segment = self._maps.get(name)
        if segment is None:
            segment = self._maps[name] = Segment.attach(name)
            segment.unlink()  # both sides hold it mapped: no name needed from here
        array = np.frombuffer(segment.map, dtype=np.uint8)
        out, offset = [], 0
        for n in (int(size) for size in ref["sizes"]):
            out.append(array[offset : offset + n].data)
            offset += n
        viewed = weakref.ref(array)
        del array

        def kept() -> bool:
            if viewed() is None:
                return False
            self._maps.pop(name, None)  # its memory goes with the last view (Segment.close leaves it)
            segment.close()
            return True

        return out, kept

    def _let_go(self, name: str) -> None:
        segment = self._maps.pop(name, None)
        if segment is not None:
            segment.close()

    def close(self) -> None:
        for name in list(self._maps):
            self._let_go(name)
