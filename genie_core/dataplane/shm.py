"""`shm`: client and server on one host move bytes through shared memory; only a segment name
travels on the control connection. Each transfer writes a segment once and the receiver adopts
it (maps it, removes its name, builds tensors on it): one copy in all.

Same host is proven, not guessed from the address: the server writes a probe file with random
contents into /dev/shm, and the client must read it there and match its digest."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ..protocol.contents import DataRef
from .base import Backend, Candidate, Channel, Found, Link, ServerSide, best_time, median_time, probe_size
from .lent import LentSegments
from .segment import (
    SHM_DIR,
    Segment,
    copy_bytes,
    pack_into,
    segment_name,
    segment_spares,
    shm_available,
    split,
    sweep_dead,
)


class ShmChannel(Channel):
    name = "shm"

    def __init__(self) -> None:
        self.spares = segment_spares("genie-c")
        self._lent: dict[int, LentSegments] = {}  # by the worker (GPU index) that maps them
        self._last = 0

    def put(self, buffers: list[Any], progress: Any = None) -> DataRef:
        total = sum(memoryview(b).nbytes for b in buffers)
        segment = self.spares.take(total, refill=False)
        self._last = total
        try:
            sizes = pack_into(segment.view, buffers, progress)
        except BaseException:
            segment.unlink()
            raise
        finally:
            segment.close()
        return {"segment": segment.name, "sizes": sizes}

    def lent_segments(self, worker: int) -> LentSegments:
        """The segments lent to one worker (GPU index): each maps its own."""
        pool = self._lent.get(worker)
        if pool is None:
            pool = self._lent[worker] = LentSegments()
        return pool

    def put_lent(self, buffers: list[Any], worker: int) -> DataRef:
        """Into a region of a segment lent to `worker` (lent.py), filled again once it is done with
        it; a one-off segment, adopted, when no lent one has room and a new one would pass the limit."""
        pool = self.lent_segments(worker)
        region = pool.take(sum(memoryview(b).nbytes for b in buffers))
        if region is None:
            ref = self.put(buffers)
            self.after()
            return ref
        ref = pool.ref(region, [])
        try:
            ref["sizes"] = pack_into(region.view, buffers)
        except BaseException:
            pool.forget(ref, sent=False)
            raise
        return ref

    def lent_to(self, ref: DataRef, request: Any) -> None:
        for pool in self._lent.values():
            pool.lend(ref, request)

    def discard(self, ref: DataRef) -> None:
        if ref.get("lent"):
            for pool in self._lent.values():
                pool.forget(ref)  # (one already lent to a request goes by its answer)
            return
        Segment.discard(ref["segment"])  # ours, and nobody adopted it

    def after(self) -> None:
        self.spares.refill(self._last)  # the next segment, faulted in while nothing else runs

    def get(self, ref: DataRef, progress: Any = None) -> list[Any]:
        return split(Segment.adopt(ref["segment"]), [int(n) for n in ref["sizes"]])

    def close(self) -> None:
        self.spares.close()
        for pool in self._lent.values():
            pool.close()


class Shm(Backend):
    name = "shm"

    def offer(self, side: ServerSide) -> dict[str, Any]:
        if not shm_available()[0]:
            return {"shm_probe": None}
        sweep_dead()  # what servers and workers killed before cleaning up left behind
        nonce = os.urandom(32)
        self.probe_file: Path | None = SHM_DIR / segment_name("genie-probe")
        fd = os.open(self.probe_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(nonce)
        return {"shm_probe": {"name": self.probe_file.name, "sha256": hashlib.sha256(nonce).hexdigest()}}

    def stop(self) -> None:
        probe_file: Path | None = getattr(self, "probe_file", None)
        if probe_file is not None:
            probe_file.unlink(missing_ok=True)

    def probe(self, link: Link, budget: float, found: Found) -> tuple[Candidate, Channel | None]:
        ok, why = shm_available()
        probe = link.server.get("shm_probe")
        if ok and probe:
            try:
                content = (SHM_DIR / str(probe["name"])).read_bytes()
                ok = hashlib.sha256(content).hexdigest() == probe["sha256"]
                why = "" if ok else "the server's shared-memory probe differs here: not the same host"
            except OSError:
                ok, why = (
                    False,
                    "the server's shared-memory probe is not visible here: a different host (or /dev/shm, or user)",
                )
        elif ok:
            ok, why = False, "the server offers no shared-memory probe"
        if not ok:
            return Candidate(self.name, False, why), None
        # What shared memory adds to an upload: the client's copy into a segment the worker has
        # mapped (lent segments are reused warm: lent.py); the segment's name rides the op's own
        # message, so no round trip of its own is timed (tcp's is: its stream and the stream's ack).
        # Timing a round trip as well made the two a coin toss at 32 MiB on an H100 machine (tcp
        # chosen in 3 of 10 sessions), where a warm 1 GiB upload over shm moved 10 to 15 GiB/s and
        # over tcp 1.1 (benchmarks/RESULTS.md). One untimed round trip checks that the server
        # takes the segment.
        size = min(32 << 20, probe_size(4e9, budget))
        payload = memoryview(bytearray(os.urandom(1024)) * (size // 1024))
        segment = Segment.create("genie-c", size)
        try:
            copy_bytes(segment.view[:size], payload)  # (faulted in once, as a reused segment is)
            link.data_probe({"segment": segment.name, "sizes": [size]}, b"")
            took = best_time(lambda: copy_bytes(segment.view[:size], payload), 3)
        finally:
            segment.close()
            segment.unlink()
        rtt = median_time(link.ping, 3)
        return Candidate(
            self.name, True, "same host: shared memory (a copy into a mapped segment)", rtt, size / took
        ), ShmChannel()
