"""Keep the server's memory flat under large messages.

glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), so after the
first multi-MiB message the next ones come from the heaps of the threads that handle them, and
fragmentation keeps that memory: a soak of pushes and pulls grew the server's RSS by 45 MiB in two
minutes. A fixed threshold (which also turns the adjustment off) returns every large block to the
kernel when it is freed. `mallopt` is glibc's; elsewhere this does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
LARGE = 1 << 20  # blocks from 1 MiB up are mapped and unmapped on their own


def map_large_blocks(threshold: int = LARGE) -> bool:
    """Have malloc map blocks of `threshold` bytes or more on their own; True if the C library agreed."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return False
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, threshold) == 1)
