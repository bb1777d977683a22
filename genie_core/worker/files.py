"""Files moved by `%genie_upload` and `%genie_download`, on the worker's side: an upload is
written piece by piece into its part file (genie_core/partfiles.py) and renamed only once its
SHA-256 matches, so a cut transfer leaves a part that the next attempt continues."""

from __future__ import annotations

import os
from pathlib import Path

from ..partfiles import hash_prefix, part_of
from ..protocol.contents import FileGet, FilePut, FileReply, FileStat


def _target(content: FileStat | FilePut | FileGet, base: Path | None) -> Path:
    """The file a request names: a relative path is in the session directory (`base`), whatever
    directory a cell has moved the worker to."""
    path = str(content.get("path", ""))
    if not path or "\x00" in path:
        raise ValueError(f"invalid path {path!r}")
    target = Path(path).expanduser()
    return target if target.is_absolute() or base is None else base / target


def stat(content: FileStat, base: Path | None) -> FileReply:
    """What is there: for an upload, the part so far (its size and hash); for a download, the
    file's size and hash, and the hash of its first `prefix` bytes (what the client holds)."""
    target = _target(content, base)
    if content.get("for") == "upload":
        part = part_of(target)
        size = part.stat().st_size if part.exists() else 0
        return FileReply(status="ok", part_size=size, part_sha256=hash_prefix(part).hexdigest() if size else "")
    if not target.is_file():
        where = f" (relative paths are in the session's directory, {base})" if base is not None else ""
        raise FileNotFoundError(f"no file {content.get('path')} on the server{where}")
    size = target.stat().st_size
    prefix = min(int(content.get("prefix") or 0), size)
    return FileReply(
        status="ok",
        size=size,
        sha256=hash_prefix(target).hexdigest(),
        prefix_sha256=hash_prefix(target, prefix).hexdigest() if prefix else "",
    )


def put(content: FilePut, data: memoryview, base: Path | None) -> FileReply:
    """Write one piece at its offset; the last one (with `sha256`) checks the whole and renames."""
    target = _target(content, base)
    part = part_of(target)
    offset = int(content.get("offset") or 0)
    if offset == 0 and part.exists():
        part.unlink()  # a fresh start
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(part, "r+b" if part.exists() else "wb") as f:
        if offset > f.seek(0, os.SEEK_END):
            raise ValueError(f"a piece at byte {offset} of {target}, but only {f.tell()} bytes are there")
        f.seek(offset)
        f.write(data)
        f.truncate()
    expected = content.get("sha256")
    if not expected:
        return FileReply(status="ok", size=offset + len(data))
    got = hash_prefix(part).hexdigest()
    if got != expected:
        part.unlink()
        raise ValueError(f"{target}: the uploaded bytes do not match the file's SHA-256 (sent {expected}, got {got})")
    os.replace(part, target)
    return FileReply(status="ok", size=target.stat().st_size, sha256=got, path=str(target.resolve()))


def read(content: FileGet, into: memoryview, base: Path | None) -> int:
    """Read `length` bytes from `offset` into `into`; returns how many."""
    target = _target(content, base)
    with open(target, "rb") as f:
        f.seek(int(content.get("offset") or 0))
        return f.readinto(into)
