"""Thread names the operating system sees (`top -H`, /proc/PID/task/*/comm, py-spy), so that a
count of a server's threads by name tells its bounded pools from anything that grows."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

PR_SET_NAME = 15  # <linux/prctl.h>
_libc: ctypes.CDLL | None = None
_tried = False


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread's OS name (at most 15 bytes) its Python name. Not the main
    thread's: that is the process's name in `ps` and `pgrep`. Off Linux, nothing."""
    global _libc, _tried
    if threading.current_thread() is threading.main_thread():
        return
    if not _tried:
        _tried, found = True, ctypes.util.find_library("c")
        _libc = ctypes.CDLL(found, use_errno=True) if found else None
    if _libc is None or not hasattr(_libc, "prctl"):
        return
    text = (name or threading.current_thread().name).encode()[:15]
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0)
