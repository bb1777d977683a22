"""What one remote device's server was sent to define: the modules of custom ops, imported there,
and custom ops defined in the notebook, sent by value (custom_ops.py). A name counts as known once
it is sent, so it goes once; but in a batch that failed, it may have been what failed (a module the
server cannot import, kernels it cannot load), so the names sent since the last good flush are
forgotten then, and go again with their next use."""

from __future__ import annotations

import threading
from typing import Any


class Definitions:
    """Names sent to one server to import or define, and those not yet seen to run."""

    def __init__(self) -> None:
        self.imported: set[str] = set()  # modules defining custom ops, imported on the server
        self.defined: dict[str, Any] = {}  # notebook custom ops sent to the server: name -> their kernels then
        self._unconfirmed: list[str] = []  # names of either sent since the last good flush
        self._lock = threading.Lock()

    def sent(self, name: str) -> None:
        """`name` (a module in `imported`, an op in `defined`) was just recorded."""
        with self._lock:
            self._unconfirmed.append(name)

    def taken(self) -> list[str]:
        """The names sent so far, for the flush that sends them last: it forgets them if it fails."""
        with self._lock:
            names, self._unconfirmed = self._unconfirmed, []
        return names

    def forget(self, names: list[str]) -> None:
        """Names a failed batch may not have defined: they go again with their next use."""
        for name in names:
            self.imported.discard(name)
            self.defined.pop(name, None)
