"""The hashing pool: threads that tag a data-plane payload's pieces while the next piece moves
(GMAC and socket calls both release the GIL), made on first use."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..threads import name_os_thread

HASHERS = min(8, os.cpu_count() or 2)  # threads of the pool
_pool: ThreadPoolExecutor | None = None


def _hashing_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=HASHERS, thread_name_prefix="genie-hash", initializer=name_os_thread)
    return _pool


def hashed_soon(hash_pieces: Callable[[Any], bytes], buffer: Any) -> Future[bytes]:
    """`hash_pieces(buffer)`, computed on the pool. The caller keeps `buffer` unchanged and alive
    until the result is in."""
    try:
        return _hashing_pool().submit(hash_pieces, buffer)
    except RuntimeError:  # the pool takes no new tasks at interpreter shutdown: hashed here
        done: Future[bytes] = Future()
        done.set_result(hash_pieces(buffer))
        return done
