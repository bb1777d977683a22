"""A file in transit, on either side: written as `NAME.genie-part` and renamed to NAME only once
its SHA-256 matches; a cut transfer continues from the part after checking the part's hash."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

SUFFIX = ".genie-part"
CHUNK = 8 << 20


def part_of(target: Path) -> Path:
    return target.with_name(target.name + SUFFIX)


def hash_prefix(path: Path, length: int | None = None) -> Any:
    """A SHA-256 object fed the file's first `length` bytes (all of it: None), to continue with."""
    digest = hashlib.sha256()
    left = path.stat().st_size if length is None else length
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest
