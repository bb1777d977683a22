"""The worker's file requests (`%genie_upload`, `%genie_download`): stat, write and read files in
the session's directory (worker/files.py), each failure answered in one line."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

from ..dataplane.base import DATA_THRESHOLD
from ..dataplane.segment import Segment
from ..protocol import Message, MessageType, contents
from . import files
from .staging import Stager
from .synced_code import SyncedCode

T = MessageType


class FileRequests:
    """A mixin of the Worker (worker/main.py): the file requests it serves, using its session
    directory, and its staging (segments, and the way to answer)."""

    synced: SyncedCode
    stager: Stager

    def on_file_stat(self, msg: Message) -> None:
        with self._file_errors():
            self._answer(files.stat(cast(contents.FileStat, msg.content), self.synced.root))

    def on_file_put(self, msg: Message) -> None:
        piece = cast(contents.FilePut, msg.content)
        ref = piece.get("data")
        data = Segment.adopt(ref["segment"]) if ref else memoryview(msg.buffers[0] if msg.buffers else b"")
        with self._file_errors():
            self._answer(files.put(piece, data[: int(ref["sizes"][0])] if ref else data, self.synced.root))

    def on_file_get(self, msg: Message) -> None:
        asked = cast(contents.FileGet, msg.content)
        length = int(asked.get("length") or 0)
        with self._file_errors():
            if asked.get("staged") and length >= DATA_THRESHOLD:  # fetched over the client's data plane
                segment = self.stager.segment(length)
                n = files.read(asked, segment.view[:length], self.synced.root)
                segment.close()
                staged = contents.DataRef(segment=segment.name, sizes=[n])
                self._answer(contents.FileReply(status="ok", data=staged))
                self.stager.spares.refill(length)
                return
            buffer = bytearray(length)
            n = files.read(asked, memoryview(buffer), self.synced.root)
            self._answer(contents.FileReply(status="ok", size=n), [bytes(buffer[:n])])

    def _answer(self, reply: contents.FileReply, buffers: list[bytes] | None = None) -> None:
        self.stager.send(T.FILE_REPLY, reply, buffers)

    @contextlib.contextmanager
    def _file_errors(self) -> Iterator[None]:
        """A file that cannot be read or written is the request's error, said in one line."""
        try:
            yield
        except (OSError, ValueError) as exc:
            self._answer(contents.FileReply(status="error", ename=type(exc).__name__, evalue=str(exc)))
