"""Unprivileged uids for sessions, leased from a subordinate range: a lock file per uid, held
(flock) by the server that leased it, so servers on one machine never share one and a server
that dies gives its uids back with its file descriptors."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import random
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

LEASES = Path("/run/genie-sandbox-uids") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir()) / "genie-uids"


def _leases() -> Path:
    """The lock files' folder: ours alone (a folder another user made in /tmp is refused)."""
    LEASES.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(LEASES)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise OSError(f"{LEASES} is not a folder of this user's alone: remove it")
    return LEASES


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
    folder = _leases()
    for _ in range(tries):
        uid = base + random.randrange(count)
        fd = os.open(folder / str(uid), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(LEASES / str(uid)).st_ino:
                raise BlockingIOError  # released (unlinked) between our open and our lock
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            continue
        return UidLease(uid, fd)
    raise OSError(f"no free uid in {base}..{base + count - 1} after {tries} tries")


@contextlib.contextmanager
def files_as(uid: int | None) -> Iterator[None]:
    """This thread's file accesses are checked as `uid` (Linux's setfsuid, per thread; a root
    thread also drops its file capabilities meanwhile): the server writes a sandboxed session's
    directory as the session, so a link a cell planted there cannot lead it elsewhere."""
    if uid is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    old_gid, old_uid = libc.setfsgid(uid), libc.setfsuid(uid)
    try:
        yield
    finally:
        libc.setfsuid(old_uid)
        libc.setfsgid(old_gid)
