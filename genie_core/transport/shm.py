"""`shm`: client and server on one host move bytes through shared memory; only a segment name
travels on the control connection. Each transfer writes a fresh segment once and the receiver
adopts it (maps it, removes its name, builds tensors on it): one copy in all."""

from __future__ import annotations

from typing import Any

from .segment import Segment, pack_into, split


class ShmTransport:
    name = "shm"

    def put(self, buffers: list[Any]) -> dict[str, Any]:
        total = sum(memoryview(b).nbytes for b in buffers)
        segment = Segment.create("genie-c", total)
        try:
            sizes = pack_into(segment.view, buffers)
        except BaseException:
            segment.unlink()
            raise
        finally:
            segment.close()
        return {"segment": segment.name, "sizes": sizes, "via": "shm"}

    def get(self, ref: dict[str, Any]) -> list[Any]:
        return split(Segment.adopt(ref["segment"]), [int(n) for n in ref["sizes"]])

    def close(self) -> None:
        pass
