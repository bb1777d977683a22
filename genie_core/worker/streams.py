"""stdout/stderr of remote code, sent to the client in small batches while the cell runs."""

from __future__ import annotations

import codecs
import io
import os
import threading
from collections.abc import Callable

FLUSH_INTERVAL = 0.05  # seconds: output appears live, but a tight print loop is batched
FLUSH_BYTES = 64 * 1024


class OutStream(io.TextIOBase):
    """A text stream whose writes become `stream` messages (name stdout or stderr)."""

    def __init__(self, name: str, emit: Callable[[str, str], None]) -> None:
        super().__init__()
        self.name = name
        self._emit = emit
        self._lock = threading.Lock()
        self._parts: list[str] = []
        self._size = 0

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if text:
            with self._lock:
                self._parts.append(text)
                self._size += len(text)
                big = self._size >= FLUSH_BYTES
            if big:
                self.flush()
        return len(text)

    def flush(self) -> None:
        # Take and emit under one lock, so batches leave in the order they were written.
        with self._lock:
            if self._parts:
                text = "".join(self._parts)
                self._parts.clear()
                self._size = 0
                self._emit(self.name, text)


def capture_fd(fd: int, stream: OutStream) -> int:
    """Send what C code and child processes write to `fd` through `stream`.

    Returns a duplicate of the original fd, for the worker's own diagnostics.
    """
    saved = os.dup(fd)
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)

    def pump() -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            try:
                chunk = os.read(read_end, 65536)
            except OSError:
                return
            if not chunk:
                return
            stream.write(decoder.decode(chunk))

    threading.Thread(target=pump, name=f"genie-fd{fd}", daemon=True).start()
    return saved
