"""A reply's big bytes staged in a shared segment for the client's data plane, instead of inline.

A GPU tensor's bytes are copied from the GPU straight into the segment (host_copies.DeviceBytes).
A client on this host adopts the segment (shm), so it is filled before the reply goes. A client
that fetches through the server's data port (tcp, ucx) gets the reply as soon as the segment is
taken, and the segment is filled after it, PART bytes at a time, each part announced (`staging`)
so the data port sends it while the next is copied (dataplane/filling.py). Once sent, that
segment comes back (Segment.send_back) and the next fetch that fits is copied into it: memory
already faulted in, where a fresh segment's page faults cost as much as the copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ..dataplane.base import DATA_THRESHOLD
from ..dataplane.segment import LateBuffer, Segment, buffer_size, pack_into, segment_spares
from ..protocol import MessageType, contents

T = MessageType
PART = 32 << 20  # bytes copied between two `staging` messages
KEEP_MAX = 1 << 30  # bytes: a bigger segment is not kept for the next fetch (it would hold /dev/shm)


class Send(Protocol):
    """How a worker sends a message to its server (Worker.send)."""

    def __call__(self, kind: MessageType, content: Mapping[str, Any], buffers: list[Any] | None = None) -> None: ...


class Stager:
    """The worker's staging of reply bytes: the segment staged last, a warm spare, and the way to
    answer. `keep`: a segment sent through a data port comes back to be filled again (not in a
    sandbox, whose segments the server moves out of its reach)."""

    def __init__(self, send: Send, keep: bool = True) -> None:
        self.send = send
        self.keep = keep
        self.spares = segment_spares("genie-w")  # one warm segment, for repeated fetches of one size
        self.staged: Segment | None = None  # the last one staged (kept mapped if it may come back)
        self._announced = 0

    def segment(self, size: int, reuse: bool = False) -> Segment:
        """A segment for `size` bytes. The one staged before goes (its client never took it), unless
        `reuse` and a data port has sent it back, and it is big enough: it is filled again."""
        old, self.staged = self.staged, None
        if old is not None and reuse and old.size >= size and old.taken_back():
            self.staged = old
            return old
        if old is not None:
            old.close()
            old.unlink()
        segment: Segment = self.spares.take(size, refill=False)
        self.staged = segment
        return segment

    def reply(
        self, kind: MessageType, content: Mapping[str, Any], buffers: list[Any], asked: Mapping[str, Any]
    ) -> None:
        """Send `content` with `buffers`: inline, or staged when `asked` says that the client fetches
        big bytes over its data plane and these are big."""
        sizes = [buffer_size(b) for b in buffers]
        total = sum(sizes)
        if not asked.get("staged") or total < DATA_THRESHOLD:
            self.send(kind, content, [b.host() if isinstance(b, LateBuffer) else b for b in buffers])
            return
        streamed = bool(asked.get("streamed"))
        kept = streamed and self.keep and total <= KEEP_MAX
        segment = self.segment(total, reuse=kept)
        ref = contents.DataRef(segment=segment.name, sizes=sizes)
        if not streamed:
            try:
                pack_into(segment.view, buffers)
            except BaseException:  # (a GPU tensor's copy that failed: the segment goes, the error is the reply)
                self.staged = None
                segment.close()
                segment.unlink()
                raise
            segment.close()
            self.send(kind, {**content, "data": ref})
            self.spares.refill(total)  # (after the reply: making it would slow the copy)
            return
        self.send(kind, {**content, "data": {**ref, "filling": True, "reused": kept}})
        self._announced = 0
        try:
            pack_into(segment.view, buffers, progress=self._filled, chunk=PART)
        except BaseException as exc:  # the data port sends what there is, and says it failed
            self.send(T.STAGING, contents.Staging(filled=0, ename=type(exc).__name__, evalue=str(exc)[:4000]))
            if not isinstance(exc, Exception):
                raise
        finally:
            if not kept:
                segment.close()  # (its memory goes once the data port has sent it)

    def _filled(self, done: int, total: int) -> None:
        """Say how far the copy got: each PART, and at the end (not after each of many small buffers)."""
        if done - self._announced >= PART or done == total:
            self._announced = done
            self.send(T.STAGING, contents.Staging(filled=done))
