"""Unprivileged uids for sessions, leased from a subordinate range: a lock file per uid, held
(flock) by the server that leased it, so servers on one machine never share one and a server
that dies gives its uids back with its file descriptors."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import tempfile
from pathlib import Path

LEASES = Path(tempfile.gettempdir()) / "genie-sandbox-uids"


class UidLease:
    def __init__(self, uid: int, fd: int) -> None:
        self.uid, self._fd = uid, fd

    def release(self) -> None:
        """Unlinked while still locked: a server that opened the old file finds, once it holds
        the lock, that the name is gone or names another file, and tries again (see lease_uid)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(LEASES / str(self.uid))
            os.close(self._fd)
            self._fd = -1


def lease_uid(base: int, count: int, tries: int = 64) -> UidLease:
    LEASES.mkdir(mode=0o700, exist_ok=True)
    for _ in range(tries):
        uid = base + random.randrange(count)
        fd = os.open(LEASES / str(uid), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(LEASES / str(uid)).st_ino:
                raise BlockingIOError  # released (unlinked) between our open and our lock
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            continue
        return UidLease(uid, fd)
    raise OSError(f"no free uid in {base}..{base + count - 1} after {tries} tries")
