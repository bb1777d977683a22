"""Files moved by `%genie_upload` and `%genie_download`, on the worker's side: an upload is
written piece by piece into `NAME.genie-part` and renamed only once its SHA-256 matches, so a cut
transfer leaves a part that the next attempt continues (after checking that part's hash)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

PART = ".genie-part"
HASH_CHUNK = 8 << 20


def sha256_of(path: Path, length: int | None = None) -> str:
    """SHA-256 of the file's first `length` bytes (all of it: None)."""
    digest = hashlib.sha256()
    left = path.stat().st_size if length is None else length
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(HASH_CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _target(path: str) -> Path:
    if not path or "\x00" in path:
        raise ValueError(f"invalid path {path!r}")
    return Path(path).expanduser()


def stat(content: dict[str, Any]) -> dict[str, Any]:
    """What is there: for an upload, the part so far (its size and hash); for a download, the
    file's size and hash, and the hash of its first `prefix` bytes (what the client holds)."""
    target = _target(str(content.get("path", "")))
    if content.get("for") == "upload":
        part = target.with_name(target.name + PART)
        size = part.stat().st_size if part.exists() else 0
        return {"status": "ok", "part_size": size, "part_sha256": sha256_of(part) if size else ""}
    if not target.is_file():
        raise FileNotFoundError(f"no file {target} on the server (relative paths are in the session's directory)")
    size = target.stat().st_size
    prefix = min(int(content.get("prefix") or 0), size)
    return {
        "status": "ok",
        "size": size,
        "sha256": sha256_of(target),
        "prefix_sha256": sha256_of(target, prefix) if prefix else "",
    }


def put(content: dict[str, Any], data: memoryview) -> dict[str, Any]:
    """Write one piece at its offset; the last one (with `sha256`) checks the whole and renames."""
    target = _target(str(content.get("path", "")))
    part = target.with_name(target.name + PART)
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
        return {"status": "ok", "size": offset + len(data)}
    got = sha256_of(part)
    if got != expected:
        part.unlink()
        raise ValueError(f"{target}: the uploaded bytes do not match the file's SHA-256 (sent {expected}, got {got})")
    os.replace(part, target)
    return {"status": "ok", "size": target.stat().st_size, "sha256": got, "path": str(target.resolve())}


def read(content: dict[str, Any], into: memoryview) -> int:
    """Read `length` bytes from `offset` into `into`; returns how many."""
    target = _target(str(content.get("path", "")))
    with open(target, "rb") as f:
        f.seek(int(content.get("offset") or 0))
        return f.readinto(into)
