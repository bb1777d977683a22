"""Errors a Genie user can see. Each message says what happened, where, and what to do."""

from __future__ import annotations


class GenieError(Exception):
    """Base class of every error Genie raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback through Genie's plumbing: one clear line (with
        # its notes, PEP 678's, such as "nothing changed: still connected to ...").
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {self}" + _notes(self)]


def _notes(exc: BaseException) -> str:
    return "".join(f"; {note}" for note in getattr(exc, "__notes__", ()))


def add_note(exc: BaseException, note: str) -> None:
    """PEP 678's `exc.add_note`, on Python 3.10 too (which has the attribute, not the method)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        setattr(exc, "__notes__", [*getattr(exc, "__notes__", ()), note])  # noqa: B010


class ConfigError(GenieError, ValueError):
    """A configuration value or argument is invalid."""


class NotInitializedError(GenieError):
    """A remote operation was attempted before connecting to a server."""

    def __init__(self, what: str = "this") -> None:
        super().__init__(f"Genie is not connected: run `%genie_init [ADDR]` (or `genie_core.init(...)`) before {what}.")


class ConnectionFailed(GenieError, ConnectionError):
    """The server could not be reached (refused, unreachable, or no answer in time)."""


class AuthenticationError(GenieError, PermissionError):
    """The server rejected our signature: the token does not match."""


class VersionMismatch(GenieError):
    """Client and server run versions that cannot work together (protocol, or Python for pickling)."""


class ConnectionLost(GenieError, ConnectionError):
    """An established connection to the server stopped answering."""


class ProtocolError(GenieError):
    """A message was malformed, unsigned, replayed or too large."""


class BadSignature(ProtocolError):
    """A message's signature does not match its bytes (the wrong key, or bytes changed after signing)."""


class LimitExceeded(GenieError):
    """A session went over a limit its server sets (remote tensors held, bytes held)."""


class MemoryLimitExceeded(LimitExceeded):
    """A session went over the bytes its server lets it hold (--max-session-bytes)."""


def size_text(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


class WorkerDied(GenieError):
    """The session's worker process ended while (or before) running a request."""


class RemoteError(GenieError):
    """An exception raised by code running on the server.

    It renders as the remote traceback in IPython (through ``_render_traceback_``), so a
    notebook shows where the remote code failed, not the client's plumbing.
    """

    def __init__(self, ename: str, evalue: str, traceback: list[str] | None = None) -> None:
        super().__init__(f"{ename}: {evalue}")
        self.ename = ename
        self.evalue = evalue
        self.traceback = list(traceback or [])

    def _render_traceback_(self) -> list[str]:
        if self.traceback:
            return [*self.traceback, *getattr(self, "__notes__", ())]
        return [f"{self.ename}: {self.evalue}" + _notes(self)]
