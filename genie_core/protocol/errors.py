"""The one map between error names on the wire and the exceptions a user sees: the server, the
worker and remote tensors send `{"ename", "evalue", "traceback"}` (`contents.Failure`);
`error_from` turns Genie's own back into their classes, `remote_error` a user's code's."""

from __future__ import annotations

from ..errors import (
    ConnectionFailed,
    ConnectionLost,
    GenieError,
    LimitExceeded,
    MemoryLimitExceeded,
    ProtocolError,
    RemoteError,
    VersionMismatch,
    WorkerDied,
)
from .contents import Failure

# Errors Genie itself raises on the server side, by name; any other name is the user's code's.
GENIE_ERRORS: dict[str, type[GenieError]] = {
    "WorkerDied": WorkerDied,
    "LimitExceeded": LimitExceeded,
    "MemoryLimitExceeded": MemoryLimitExceeded,
    "ProtocolError": ProtocolError,
    "VersionMismatch": VersionMismatch,
    "SessionInUse": ConnectionFailed,  # a named session another user's client holds
}
SESSION_NOT_FOUND = "SessionNotFound"


def error_content(ename: str, evalue: str, traceback: list[str] | None = None) -> Failure:
    """The content of an error reply."""
    content = Failure(ename=ename, evalue=evalue)
    if traceback:
        content["traceback"] = traceback
    return content


def error_from(content: Failure, context: str = "") -> Exception:
    """The exception an error reply stands for (`context` goes before a user's error's value)."""
    ename, evalue = str(content.get("ename", "Error")), str(content.get("evalue", ""))
    if ename == SESSION_NOT_FOUND:
        return ConnectionLost(evalue + "; run %genie_init (or genie_core.init) again to start a new session")
    known = GENIE_ERRORS.get(ename)
    if known is not None:
        return known(evalue)
    return remote_error(content, context)


def remote_error(content: Failure, context: str = "") -> RemoteError:
    """What a user's code raised on the server (an `error` output, a failed cell), whatever its
    name: a cell's own `ProtocolError` is not Genie's."""
    ename, evalue = str(content.get("ename", "Error")), str(content.get("evalue", ""))
    return RemoteError(ename, context + evalue, content.get("traceback"))


def error_text(content: Failure) -> str:
    """`ename: evalue` of an error reply (bounded), or "" when it names no error."""
    return f"{content['ename']}: {content.get('evalue', '')}"[:500] if content.get("ename") else ""
