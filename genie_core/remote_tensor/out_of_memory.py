"""Out of memory on the remote device, said as PyTorch says it. The server device's allocator
running out, or the session reaching the bytes the server lets it hold (`--max-session-bytes`; not
its count of tensors, which a smaller batch does not mend), is raised as an exception that is also
`torch.OutOfMemoryError` (which
`torch.cuda.OutOfMemoryError` is), its message beginning as CUDA's does, so that code which shrinks
a batch on OOM works on this device as on CUDA (accelerate's `find_executable_batch_size`, which
looks for " out of memory." in the message; a hand-written loop)."""

from __future__ import annotations

import torch

from ..errors import MemoryLimitExceeded, RemoteError


class RemoteOutOfMemoryError(RemoteError, torch.OutOfMemoryError):
    """The server device's allocator ran out (its message and traceback as the server gave them)."""


class SessionMemoryReached(MemoryLimitExceeded, torch.OutOfMemoryError):
    """The session holds the bytes its server lets it hold."""


def as_torch(exc: Exception, device_type: str) -> Exception:
    """`exc`, as an out-of-memory error of `device_type` where it is one; anything else as it is."""
    if type(exc) is MemoryLimitExceeded:  # (said as CUDA says it first: tools look for " out of memory.")
        return SessionMemoryReached(f"{device_type} out of memory. {exc}")
    if type(exc) is RemoteError and exc.ename == "OutOfMemoryError":
        return RemoteOutOfMemoryError(exc.ename, exc.evalue, exc.traceback)
    return exc
