"""The data-plane interface: every backend moves a list of buffers to the server side
(`put`, returning a reference the control message carries) and back (`get`)."""

from __future__ import annotations

from typing import Any, Protocol

DATA_THRESHOLD = 1 << 20  # bytes: transfers at least this big use the data plane; smaller ones travel inline


class Transport(Protocol):
    name: str

    def put(self, buffers: list[Any], progress: Any = None) -> dict[str, Any] | None:
        """Stage buffers where the session's worker can read them; None means "send inline".
        `progress(done, total)` is called as bytes go."""
        ...

    def get(self, ref: dict[str, Any], progress: Any = None) -> list[Any]:
        """Fetch buffers a worker staged (ref from its reply)."""
        ...

    def close(self) -> None: ...


class InlineTransport:
    """`zmq`: buffers travel inside the signed control messages. Always available."""

    name = "zmq"

    def put(self, buffers: list[Any], progress: Any = None) -> dict[str, Any] | None:
        return None

    def get(self, ref: dict[str, Any], progress: Any = None) -> list[Any]:
        raise RuntimeError("inline transfers carry their buffers in the message")

    def close(self) -> None:
        pass
