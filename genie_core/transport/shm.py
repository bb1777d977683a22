"""`shm`: client and server on one host move bytes through shared memory; only a segment name
travels on the control connection. Each transfer writes a fresh segment once and the receiver
adopts it (maps it, removes its name, builds tensors on it): one copy in all."""

from __future__ import annotations

from typing import Any

from .segment import Segment, pack_into, segment_spares, split


class ShmTransport:
    name = "shm"

    def __init__(self) -> None:
        self.spares = segment_spares("genie-c")

    def put(self, buffers: list[Any], progress: Any = None) -> dict[str, Any]:
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
        return {"segment": segment.name, "sizes": sizes, "via": "shm"}

    def after(self) -> None:
        """The transfer is over: prepare the next segment now."""
        self.spares.refill(getattr(self, "_last", 0))

    def get(self, ref: dict[str, Any], progress: Any = None) -> list[Any]:
        return split(Segment.adopt(ref["segment"]), [int(n) for n in ref["sizes"]])

    def close(self) -> None:
        self.spares.close()
