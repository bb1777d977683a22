"""A remote op's error, raised as PyTorch raises it, so that code written for the CPU or CUDA
catches it:
- out of memory (the server device's allocator running out, or the session reaching the bytes the
  server lets it hold, `--max-session-bytes`; not its count of tensors, which a smaller batch does
  not mend) is also `torch.OutOfMemoryError` (which `torch.cuda.OutOfMemoryError` is), its message
  beginning as CUDA's does: code that shrinks a batch on OOM works (accelerate's
  `find_executable_batch_size`, which looks for " out of memory." in the message; a hand-written
  loop);
- an error of Python's or PyTorch's own kind on the server (an out-of-bounds index's `IndexError`,
  a singular matrix's `torch.linalg.LinAlgError`, `RuntimeError`) is also of that kind:
  `except IndexError:` catches it. Each stays a `RemoteError`, with the server's traceback."""

from __future__ import annotations

import torch

from ..errors import MemoryLimitExceeded, RemoteError


class RemoteOutOfMemoryError(RemoteError, torch.OutOfMemoryError):
    """The server device's allocator ran out (its message and traceback as the server gave them)."""


class SessionMemoryReached(MemoryLimitExceeded, torch.OutOfMemoryError):
    """The session holds the bytes its server lets it hold."""


# The kinds a remote error is also raised as, by the name the server gives (not KeyError, whose
# message Python quotes, nor OSError's family, whose arguments mean other things).
_KINDS: dict[str, type[Exception]] = {
    kind.__name__: kind
    for kind in (
        RuntimeError,
        IndexError,
        ValueError,
        TypeError,
        NotImplementedError,
        ZeroDivisionError,
        AssertionError,
        OverflowError,
        AttributeError,
    )
}
_KINDS["LinAlgError"] = _KINDS["_LinAlgError"] = torch.linalg.LinAlgError  # type: ignore[attr-defined]
_remote_kinds: dict[type[Exception], type[RemoteError]] = {}


def as_torch(exc: Exception, device_type: str) -> Exception:
    """`exc`, as an out-of-memory error of `device_type`, or as its server-side kind, where it is
    one; anything else as it is."""
    if type(exc) is MemoryLimitExceeded:  # (said as CUDA says it first: tools look for " out of memory.")
        return SessionMemoryReached(f"{device_type} out of memory. {exc}")
    if type(exc) is not RemoteError:
        return exc
    if exc.ename == "OutOfMemoryError":
        return RemoteOutOfMemoryError(exc.ename, exc.evalue, exc.traceback)
    kind = _KINDS.get(exc.ename)
    if kind is None:
        return exc
    remote_kind = _remote_kinds.get(kind)
    if remote_kind is None:  # (RemoteIndexError, ...: made once each)
        remote_kind = type(f"Remote{kind.__name__.lstrip('_')}", (RemoteError, kind), {"__module__": __name__})
        _remote_kinds[kind] = remote_kind
    return remote_kind(exc.ename, exc.evalue, exc.traceback)
