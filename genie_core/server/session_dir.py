"""A session's own directory on the server, where `%genie_sync` puts the notebook's code and small
data files: content-addressed (a file whose hash is unchanged is not sent again), written
atomically, and never outside the directory. The session's workers run in it, with it on sys.path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path, PurePosixPath
from typing import Any

from ..protocol.contents import SyncReply
from ..sandbox.uids import files_as

MAX_FILES = 10_000


class SyncError(ValueError):
    """A sync request that cannot be applied (a bad path, or content that does not match its hash)."""


def _safe(relpath: str) -> PurePosixPath:
    """A relative path that stays inside the directory, or SyncError."""
    path = PurePosixPath(relpath)
    if not relpath or "\x00" in relpath or "\\" in relpath or path.is_absolute() or ".." in path.parts:
        raise SyncError(f"refused to sync {relpath!r}: only relative paths inside the session directory")
    if any(part.startswith(".") for part in path.parts):
        raise SyncError(f"refused to sync {relpath!r}: hidden files are not synced")
    return path


class SessionDirectory:
    """The directory, and the hash of each file synced into it."""

    def __init__(self, root: Path, owner: int | None = None) -> None:
        self.root = root
        self.owner = owner  # a sandboxed session's uid: its files are written as it
        self.hashes: dict[str, str] = {}  # what is there now: relative path -> SHA-256
        self.generation = 0  # bumped at each change: workers re-import changed modules when it moves
        self._lock = threading.Lock()  # one sync at a time (each runs on a thread of its own)

    def apply(self, manifest: dict[str, Any], files: dict[str, bytes]) -> SyncReply:
        """Make the directory hold `manifest` (path -> SHA-256): write `files` (their content),
        remove what the manifest no longer lists, and say which files are still missing."""
        with self._lock, files_as(self.owner):
            return self._apply(manifest, files)

    def _apply(self, manifest: dict[str, Any], files: dict[str, bytes]) -> SyncReply:
        if len(manifest) > MAX_FILES:
            raise SyncError(f"{len(manifest)} files to sync: at most {MAX_FILES}")
        wanted = {str(_safe(str(p))): str(h) for p, h in manifest.items()}
        for path, data in files.items():
            if wanted.get(path) != hashlib.sha256(data).hexdigest():
                raise SyncError(f"{path}: its content does not match its hash (changed while being sent?)")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        written = 0
        for path, data in files.items():
            target = self.root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.genie-tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
            self.hashes[path] = wanted[path]
            written += 1
        removed = 0
        for path in [p for p in self.hashes if p not in wanted]:
            (self.root / path).unlink(missing_ok=True)
            del self.hashes[path]
            removed += 1
        if written or removed:
            self.generation += 1
        missing = sorted(p for p, h in wanted.items() if self.hashes.get(p) != h)
        return {
            "missing": missing,
            "written": written,
            "removed": removed,
            "unchanged": len(wanted) - len(missing) - written,
            "generation": self.generation,
            "dir": str(self.root),
        }

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
