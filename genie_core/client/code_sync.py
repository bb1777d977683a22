"""`%genie_sync`: the notebook's working directory (its Python files and small data files) in the
session's own directory on the server, so that `import mymodel` works in remote cells and a pushed
object whose class lives in mymodel unpickles there. What .gitignore ignores is left out; files are
content-hashed, so an unchanged file is never sent twice; a scan that finds nothing changed
(same sizes and modification times) costs no round trip, so it can run before every remote cell.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LimitExceeded, size_text
from ..protocol.contents import SyncReply

MAX_FILE = 1 << 20  # bytes: larger data files are left out (Python files are always sent)
MAX_TOTAL = 50 << 20  # bytes: a sync over this is refused, naming the biggest files
SKIPPED_DIRS = {"__pycache__", "node_modules", "venv", "env", "build", "dist"}
SKIPPED_SUFFIXES = {".pyc", ".pyo", ".ipynb"}

Send = Callable[[dict[str, str], list[str], list[bytes]], SyncReply]  # manifest, names, contents -> reply


@dataclass
class SyncReport:
    root: Path
    sent: list[str] = field(default_factory=list)
    unchanged: int = 0
    removed: int = 0
    bytes_sent: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    remote_dir: str = ""

    def __str__(self) -> str:
        text = (
            f"synced {self.root} -> {self.remote_dir or 'the session directory'}: {len(self.sent)} file"
            f"{'s' if len(self.sent) != 1 else ''} sent ({size_text(self.bytes_sent)}), {self.unchanged} unchanged"
        )
        if self.removed:
            text += f", {self.removed} removed"
        if self.skipped:
            shown = ", ".join(f"{p} ({why})" for p, why in self.skipped[:5])
            text += f"; left out: {shown}" + (f" and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else "")
        return text


class CodeSync:
    def __init__(self, root: str | Path = ".", max_file: int = MAX_FILE, max_total: int = MAX_TOTAL) -> None:
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"cannot sync {root}: not a directory")
        self.max_file, self.max_total = max_file, max_total
        self._hashes: dict[str, tuple[tuple[int, int], str]] = {}  # path -> (stamp, SHA-256), to skip re-hashing
        self._synced: dict[str, tuple[int, int]] | None = None  # stamps as of the last sync

    # -- which files ------------------------------------------------------------------------
    def candidates(self) -> list[str]:
        """Relative paths of the files under the root that .gitignore does not exclude."""
        listed = _git_files(self.root)
        if listed is None:
            listed = _walk(self.root)
        keep = []
        for rel in listed:
            parts = Path(rel).parts
            if any(p.startswith(".") or p in SKIPPED_DIRS for p in parts) or Path(rel).suffix in SKIPPED_SUFFIXES:
                continue
            if (self.root / rel).is_file():
                keep.append(rel)
        return sorted(keep)

    def _stamps(self) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str]]]:
        stamps, skipped = {}, []
        for rel in self.candidates():
            st = (self.root / rel).stat()
            if not rel.endswith(".py") and st.st_size > self.max_file:
                skipped.append((rel, f"{size_text(st.st_size)}, over {size_text(self.max_file)}"))
                continue
            stamps[rel] = (st.st_mtime_ns, st.st_size)
        total = sum(size for _, size in stamps.values())
        if total > self.max_total:
            biggest = sorted(stamps, key=lambda r: -stamps[r][1])[:3]
            raise LimitExceeded(
                f"the files to sync under {self.root} come to {size_text(total)}, over the "
                f"{size_text(self.max_total)} cap: add what the server does not need to .gitignore, or raise the cap "
                f"(--max-total); the biggest: " + ", ".join(f"{r} ({size_text(stamps[r][1])})" for r in biggest)
            )
        return stamps, skipped

    # -- syncing ----------------------------------------------------------------------------
    def run_if_changed(self, send: Send) -> SyncReport | None:
        """`run`, if anything differs from the last sync (sizes, times, files added or gone);
        None, and no round trip, if nothing does. One scan either way."""
        scan = self._stamps()
        if self._synced is not None and scan[0] == self._synced:
            return None
        return self.run(send, scan=scan)

    def run(
        self,
        send: Send,
        attempts: int = 3,
        scan: tuple[dict[str, tuple[int, int]], list[tuple[str, str]]] | None = None,
    ) -> SyncReport:
        """Send what the server lacks: one round trip when nothing changed, two otherwise."""
        stamps, skipped = scan or self._stamps()
        manifest = {rel: self._hash(rel, stamp) for rel, stamp in stamps.items()}
        report = SyncReport(self.root, skipped=skipped)
        reply = send(manifest, [], [])
        missing = list(reply.get("missing") or [])
        report.removed = int(reply.get("removed") or 0)
        if missing:
            contents = [(self.root / rel).read_bytes() for rel in missing]
            for rel, data in zip(missing, contents, strict=True):
                if hashlib.sha256(data).hexdigest() != manifest[rel]:  # changed since it was hashed: again
                    if attempts <= 1:
                        raise RuntimeError(f"{rel} keeps changing while it is synced: try again when it is saved")
                    return self.run(send, attempts - 1)
            reply = send(manifest, missing, contents)
            if reply.get("missing"):
                raise RuntimeError(f"the server still lacks {reply['missing'][:3]} after a sync")
            report.sent, report.bytes_sent = missing, sum(len(c) for c in contents)
        report.unchanged = len(manifest) - len(report.sent)
        report.remote_dir = str(reply.get("dir") or "")
        self._synced = stamps
        return report

    def _hash(self, rel: str, stamp: tuple[int, int]) -> str:
        known = self._hashes.get(rel)
        if known is not None and known[0] == stamp:
            return known[1]
        digest = hashlib.sha256((self.root / rel).read_bytes()).hexdigest()
        self._hashes[rel] = (stamp, digest)
        return digest


def _git_files(root: Path) -> list[str] | None:
    """Tracked and untracked-but-not-ignored files, as git sees them; None outside a work tree."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [p for p in out.stdout.decode(errors="surrogateescape").split("\0") if p]


def _walk(root: Path) -> list[str]:
    """Every file under root, less what root's .gitignore excludes (outside a git work tree)."""
    import pathspec

    ignore = root / ".gitignore"
    spec = pathspec.GitIgnoreSpec.from_lines(ignore.read_text().splitlines() if ignore.exists() else [])
    found = []
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root)
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".")
            and d not in SKIPPED_DIRS
            and not spec.match_file(f"{(rel_folder / d).as_posix()}/")
        ]
        for name in files:
            rel = (rel_folder / name).as_posix()
            if not spec.match_file(rel):
                found.append(rel)
    return found
