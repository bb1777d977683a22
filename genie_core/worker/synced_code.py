"""The notebook's own modules in a worker: the session directory `%genie_sync` fills goes on
sys.path (and becomes the working directory, so relative paths mean what they mean in the
notebook); when its files change, the modules imported from it are re-imported, as IPython's
autoreload does, the changed ones and every synced module imported after them."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("genie.worker")


class SyncedCode:
    def __init__(self) -> None:
        self.root: Path | None = None
        self.generation = 0
        self.seen: dict[str, tuple[int, int]] = {}  # module name -> (mtime_ns, size) of its file when imported

    def update(self, sync: Any) -> list[str]:
        """Apply the server's note on the session directory (`{"dir", "generation"}`); returns the
        modules re-imported. A failing re-import is logged and the old module kept."""
        if not isinstance(sync, dict) or not sync.get("dir"):
            return []
        root = Path(str(sync["dir"])).resolve()
        if self.root != root:
            self.root = root
            sys.path.insert(0, str(root))
            os.chdir(root)
            self.note_imports()
        generation = int(sync.get("generation") or 0)
        if generation == self.generation:
            return []
        self.generation = generation
        importlib.invalidate_caches()  # new files become importable
        return self._reload_changed()

    def _synced(self) -> list[tuple[str, Any, Path]]:
        """Modules imported from the session directory, in the order they were imported."""
        if self.root is None:
            return []
        prefix = str(self.root) + os.sep
        found = []
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if isinstance(file, str) and file.startswith(prefix):
                found.append((name, module, Path(file)))
        return found

    def note_imports(self) -> None:
        """Remember the file of each synced module imported since (after every request: cheap,
        a string test per module), so a later change of it is seen as one."""
        for name, _, path in self._synced():
            if name not in self.seen:
                self.seen[name] = _stamp(path)

    def _reload_changed(self) -> list[str]:
        synced = self._synced()
        first = next((i for i, (name, _, path) in enumerate(synced) if self.seen.get(name) != _stamp(path)), None)
        reloaded = []
        for name, module, path in synced[first:] if first is not None else []:
            if not path.exists():
                continue  # its file was removed: the module stays as it was
            with contextlib.suppress(OSError, ValueError):  # an edit of the same size in the same second
                os.unlink(importlib.util.cache_from_source(str(path)))  # would pass its bytecode's check
            try:
                importlib.reload(module)
                reloaded.append(name)
            except Exception as exc:
                log.warning("could not re-import %s after a sync: %s", name, exc)
                print(f"genie: re-importing {name} after %genie_sync failed: {exc!r}", file=sys.stderr)
            self.seen[name] = _stamp(path)
        self.note_imports()
        return reloaded


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_size)
