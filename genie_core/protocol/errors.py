"""The one map between error names on the wire and the exceptions a user sees: the server, the
worker and remote tensors send `{"ename", "evalue", "traceback"}`; `error_from` turns it back."""

from __future__ import annotations

from typing import Any

from ..errors import (
    ConnectionFailed,
    ConnectionLost,
    GenieError,
    LimitExceeded,
    ProtocolError,
    RemoteError,
    VersionMismatch,
    WorkerDied,
)

# Errors Genie itself raises on the server side, by name; any other name is the user's code's.
GENIE_ERRORS: dict[str, type[GenieError]] = {
    "WorkerDied": WorkerDied,
    "LimitExceeded": LimitExceeded,
    "ProtocolError": ProtocolError,
    "VersionMismatch": VersionMismatch,
    "SessionInUse": ConnectionFailed,  # a named session another user's client holds
}
SESSION_NOT_FOUND = "SessionNotFound"


def error_content(ename: str, evalue: str, traceback: list[str] | None = None) -> dict[str, Any]:
    """The content of an error reply."""
    content: dict[str, Any] = {"ename": ename, "evalue": evalue}
    if traceback:
        content["traceback"] = traceback
    return content


def error_from(content: dict[str, Any]) -> Exception:
    """The exception an error reply stands for."""
    ename, evalue = str(content.get("ename", "Error")), str(content.get("evalue", ""))
    if ename == SESSION_NOT_FOUND:
        return ConnectionLost(evalue + "; run %genie_init (or genie_core.init) again to start a new session")
    known = GENIE_ERRORS.get(ename)
    if known is not None:
        return known(evalue)
    return RemoteError(ename, evalue, content.get("traceback"))


def error_text(content: dict[str, Any]) -> str:
    """`ename: evalue` of an error reply (bounded), or "" when it names no error."""
    return f"{content['ename']}: {content.get('evalue', '')}"[:500] if content.get("ename") else ""
