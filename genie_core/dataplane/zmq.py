"""`zmq`: buffers travel inside the signed control messages themselves. Always available; the
only path when nothing else is (and, with `--encrypt`, the encrypted one)."""

from __future__ import annotations

from typing import Any

from ..protocol.contents import DataRef
from .base import Backend, Candidate, Channel, Found, Link, best_time, median_time, probe_size


class InlineChannel(Channel):
    name = "zmq"
    staged = False  # a pull's bytes come back in its reply

    def put(self, buffers: list[Any], progress: Any = None) -> DataRef | None:
        return None  # send them inline


class Zmq(Backend):
    name = "zmq"

    def probe(self, link: Link, budget: float, found: Found) -> tuple[Candidate, Channel | None]:
        rtt = median_time(link.ping, 5)
        small = bytes(256 << 10)
        guess = len(small) / max(median_time(lambda: link.data_probe(None, small), 1), 1e-6)
        blob = bytes(min(4 << 20, probe_size(guess, budget)))
        took = best_time(lambda: link.data_probe(None, blob), 2)
        how = "CURVE-encrypted, buffers signed inline" if link.server.get("encrypted") else "buffers signed inline"
        return Candidate(self.name, True, f"the control connection ({how})", rtt, len(blob) / took), InlineChannel()
