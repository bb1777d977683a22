"""`%genie_upload` and `%genie_download`: a file moved in 64 MiB pieces over the session's data
plane, checked end to end with SHA-256. A transfer cut by a lost connection waits for the server
to answer again and continues where the part file ends (once that part's hash matches); run again
later, it continues too. Nothing is renamed into place until its hash matches.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..errors import ConnectionLost
from ..partfiles import hash_prefix, part_of
from ..protocol import MessageType, contents
from .connection import Connection
from .transfers import Transfers

T = MessageType
PIECE = 64 << 20
ATTEMPTS = 5  # lost connections one transfer rides out

Progress = Callable[[int, int], None]


@dataclass
class FileResult:
    path: str  # where it landed (the server's absolute path, for an upload)
    size: int
    sha256: str
    resumed_from: int  # bytes already there from an earlier, cut attempt
    seconds: float

    def __str__(self) -> str:
        resumed = f", continued from byte {self.resumed_from:,}" if self.resumed_from else ""
        return f"{self.path}: {self.size:,} bytes in {self.seconds:.2f} s, SHA-256 {self.sha256[:16]}…{resumed}"


class FileTransfers:
    def __init__(self, connection: Connection, transfers: Transfers, reconnect_wait: float = 60.0) -> None:
        self.connection, self.transfers, self.reconnect_wait = connection, transfers, reconnect_wait

    def upload(self, local: str | Path, remote: str | None = None, progress: Progress | None = None) -> FileResult:
        source = Path(local).expanduser()
        if not source.is_file():
            raise FileNotFoundError(f"cannot upload {local}: no such file here")
        return self._resumable(lambda: self._upload(source, remote or source.name, progress))

    def download(self, remote: str, local: str | Path | None = None, progress: Progress | None = None) -> FileResult:
        target = Path(local if local is not None else Path(remote).name).expanduser()
        if target.is_dir():
            target = target / Path(remote).name
        return self._resumable(lambda: self._download(remote, target, progress))

    # -- the steps ------------------------------------------------------------------------------
    def _resumable(self, attempt: Callable[[], FileResult]) -> FileResult:
        """Run `attempt`; after a lost connection, wait for the server and run it again (it resumes)."""
        for tries in range(ATTEMPTS):
            try:
                return attempt()
            except ConnectionLost:
                if tries == ATTEMPTS - 1 or not self._wait_for_server():
                    raise
        raise AssertionError("unreachable")

    def _wait_for_server(self) -> bool:
        deadline = time.monotonic() + self.reconnect_wait
        while time.monotonic() < deadline and not self.connection.closed and not self.connection.session_gone:
            if self.connection.connected:
                return True
            time.sleep(0.1)
        return False

    def _upload(self, source: Path, remote: str, progress: Progress | None) -> FileResult:
        start = time.monotonic()
        size = source.stat().st_size
        stat: contents.FileStat = {"path": remote, "for": "upload"}
        there = cast(contents.FileReply, self.transfers.send(T.FILE_STAT, stat, []))
        offset, digest = int(there.get("part_size") or 0), hashlib.sha256()
        if 0 < offset <= size:
            digest = hash_prefix(source, offset)
            if digest.hexdigest() != there.get("part_sha256"):
                offset, digest = 0, hashlib.sha256()  # the part is of another file: start again
        else:
            offset = 0
        resumed_from = offset
        reply = contents.FileReply(status="")
        with open(source, "rb") as f:
            f.seek(offset)
            while True:
                piece = f.read(PIECE)
                digest.update(piece)
                last = offset + len(piece) >= size
                content = contents.FilePut(path=remote, offset=offset)
                if last:
                    content["sha256"] = digest.hexdigest()
                at = offset
                shifted = _shifted(progress, at, size)
                sent = self.transfers.send(T.FILE_PUT, content, [piece], progress=shifted, timeout=None)
                reply = cast(contents.FileReply, sent)
                offset += len(piece)
                if progress is not None:
                    progress(offset, size)
                if last:
                    break
        return FileResult(
            str(reply.get("path", remote)), size, str(reply["sha256"]), resumed_from, time.monotonic() - start
        )

    def _download(self, remote: str, target: Path, progress: Progress | None) -> FileResult:
        start = time.monotonic()
        part = part_of(target)
        have = part.stat().st_size if part.exists() else 0
        stat: contents.FileStat = {"path": remote, "prefix": have}
        there = cast(contents.FileReply, self.transfers.send(T.FILE_STAT, stat, []))
        size, expected = int(there["size"]), str(there["sha256"])
        digest = hashlib.sha256()
        if 0 < have <= size:
            digest = hash_prefix(part, have)
            if digest.hexdigest() != there.get("prefix_sha256"):
                have, digest = 0, hashlib.sha256()
        else:
            have = 0
        resumed_from = offset = have
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(part, "r+b" if part.exists() else "wb") as f:
            f.truncate(offset)
            f.seek(offset)

            def write(reply: contents.FileReply, buffers: list[Any]) -> int:
                data = memoryview(buffers[0]).cast("B") if buffers else memoryview(b"")
                f.write(data)
                digest.update(data)
                return data.nbytes

            while offset < size:
                length = min(PIECE, size - offset)
                piece = contents.FileGet(path=remote, offset=offset, length=length)
                got = self.transfers.fetch(T.FILE_GET, piece, write, _shifted(progress, offset, size))
                if got == 0:
                    raise OSError(f"{remote} on the server ended at byte {offset:,}: it changed during the download")
                offset += got
                if progress is not None:
                    progress(offset, size)
        if digest.hexdigest() != expected:
            part.unlink()
            raise OSError(f"{remote}: the downloaded bytes do not match its SHA-256 (it changed during the download?)")
        os.replace(part, target)
        return FileResult(str(target.resolve()), size, expected, resumed_from, time.monotonic() - start)


def _shifted(progress: Progress | None, offset: int, total: int) -> Progress | None:
    """A piece's progress as progress through the whole file."""
    if progress is None:
        return None
    return lambda done, _: progress(offset + done, total)
