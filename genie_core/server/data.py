"""The server's side of the data plane: every backend in the registry offered to clients (the
slow ones after the server is ready), and the checks on what a push or probe names."""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..dataplane import ServerSide, backends
from ..dataplane.segment import SHM_DIR
from ..dataplane.stream import DataHost
from ..protocol.contents import DataRef
from ..threads import name_os_thread

log = logging.getLogger("genie.server")


class DataPlane:
    def __init__(self, side: ServerSide) -> None:
        self.side = side
        self.backends = backends()
        self.info: dict[str, Any] = {"encrypted": side.encrypted, "detect": {}}  # what clients learn in the welcome

    @property
    def host(self) -> DataHost:
        return self.side.host

    def start(self, control_port: int) -> None:
        """Offer every backend, beside the server's control port (bound by now)."""
        self.side.control_port = control_port
        for backend in self.backends:
            if not backend.slow_start:
                self._offer(backend)
        threading.Thread(target=self._start_slow, name="genie-detect", daemon=True).start()

    def _start_slow(self) -> None:
        name_os_thread()
        for backend in self.backends:
            if backend.slow_start:
                self._offer(backend)

    def _offer(self, backend: Any) -> None:
        try:
            offered = backend.offer(self.side)
        except Exception:
            log.exception("the %s data plane could not start", backend.name)
            return
        for key, value in offered.items():
            if isinstance(value, dict) and isinstance(self.info.get(key), dict):
                self.info[key].update(value)
            else:
                self.info[key] = value

    def stop(self) -> None:
        for backend in self.backends:
            try:
                backend.stop()
            except Exception:
                log.exception("stopping the %s data plane", backend.name)

    def check_ref(self, ref: Any, session_id: str) -> str:
        """A segment a push or probe names must be this session's: one a data listener filled for
        it, or one its client made on this host (same user, who can read our /dev/shm anyway).
        Returns "" or why not."""
        if not ref:
            return ""
        name = str(ref.get("segment", ""))
        owner = self.host.owners.get(name)
        if owner is not None:
            return "" if owner == session_id else f"segment {name!r} does not belong to this session"
        if name.startswith("genie-c-") and "/" not in name:
            return ""
        return f"not a segment of this session: {name!r}"

    @staticmethod
    def probe(ref: DataRef | None, buffers: list[Any]) -> int:
        """Discovery's round trip: bytes inline, or a segment the client filled (its size). Not
        mapped here: uploads land in segments their worker mapped once, so shared memory is measured
        by its transport (the client's copy, this round trip) as tcp is by its stream into a buffer
        in use (mapping it here each time lost shm the choice on an H100: benchmarks/RESULTS.md)."""
        if not ref:
            return sum(len(b) for b in buffers)
        try:
            return (SHM_DIR / ref["segment"]).stat().st_size
        except OSError:
            return 0
