"""Requests cut off by a lost connection, and what the client learns of them afterwards.

Each request that acts on the worker runs at most once; when the server answers again, the
client asks what became of the cut-off ones, on the same connection (so the question travels
behind them and the answer is final), and keeps the answer here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from ..errors import ConnectionLost
from ..events import EventType, Severity
from ..protocol import RUNS, TERMINAL, Message, MessageType, contents, error_text
from ..protocol.errors import SESSION_NOT_FOUND
from .connection import Closed, Connection, Request

log = logging.getLogger("genie.client")

T = MessageType
KEEP_OUTPUT = 64 << 10  # characters of a lost cell's late output kept to show
KEEP_LOST = 100  # lost requests remembered
OUTCOME_WAIT = 10.0  # seconds for one "did it run?" answer
OUTCOME_TRIES = 3  # then the outcome is reported unknown


@dataclass
class LostRequest:
    """A request whose connection was lost before its answer came: did it run?

    `state` is "unknown" until the server answers again, then "running", "finished" (see
    `status`: ok or error), "stopped" (it was running when the server ended the session), "not
    run" (the server never ran it), or "unknown" for good when the server cannot say (it
    restarted). `settled` once the answer is final. Late output of a cell is kept in `output`.
    """

    id: str
    type: str
    summary: str
    lost_at: float
    state: str = "unknown"
    status: str = ""
    error: str = ""
    output: str = ""
    settled: bool = False
    reported: bool = False

    def describe(self) -> str:
        sent_at = time.strftime("%H:%M:%S", time.localtime(self.lost_at))
        what = f"{'the cell' if self.type == 'execute' else 'the ' + self.type} sent at {sent_at}"
        what += f" ({self.summary})" if self.summary else ""
        if self.state == "finished":
            return f"{what} ran on the server after all and finished {self.status}" + (
                f" ({self.error})" if self.error else ""
            )
        if self.state == "stopped":
            return f"{what} was running on the server and was {self.error}"
        if self.state == "not run":
            return f"{what} did not run: {self.error or 'it never reached the server'}"
        if self.state == "running":
            return f"{what} is still running on the server"
        return f"{what}: unknown whether it ran" + (f" ({self.error})" if self.error else "")


Emit = Callable[..., None]  # emit(EventType, Severity, message, **data)


class Recovery:
    """Listens to a connection: fails what a lost connection cut off (remembering the requests
    that may have run), keeps their late output, and asks the server what became of them."""

    def __init__(self, connection: Connection, emit: Emit) -> None:
        self.connection = connection
        self.emit = emit
        self.lost: dict[str, LostRequest] = {}
        connection.on_lost = self._on_lost
        connection.on_back = self._on_back
        connection.on_orphan = self._on_orphan
        connection.on_session_gone = lambda why: (
            self._ask_in_background()
        )  # the server keeps an ended session's record a while

    def _on_lost(self, reason: str, cut: list[Request]) -> None:
        for request in cut:
            why = reason
            if request.type in RUNS and not request.background:
                self.lost[request.id] = LostRequest(request.id, request.type, request.summary, time.time())
                while len(self.lost) > KEEP_LOST:
                    self.lost.pop(next(iter(self.lost)))
                what = "cell" if request.type == T.EXECUTE else request.type
                why += (
                    f". The {what} had been sent and may still run there: "
                    "whether it ran is reported once the server answers again"
                )
            request.put(Closed(ConnectionLost(why)))
        last_seen = time.time() - (time.monotonic() - self.connection.last_heard)
        self.emit(EventType.NODE_LOST, Severity.ERROR, reason, last_seen=last_seen)

    def _on_back(self) -> None:
        """The server answers again (after a partition or a pause): ask about what was cut off."""
        self.emit(EventType.NODE_RECOVERED, Severity.INFO, f"{self.connection.address} answers again")
        self._ask_in_background()

    def _on_orphan(self, msg: Message) -> None:
        """A reply to a request we gave up on: it ran after all. Keep its output; settle it at the end."""
        lost = self.lost.get(msg.parent)
        if lost is None:
            return
        if msg.type == T.STREAM and len(lost.output) < KEEP_OUTPUT:
            text = cast(contents.Stream, msg.content).get("text", "")
            lost.output += str(text)[: KEEP_OUTPUT - len(lost.output)]
        elif msg.type == T.ERROR:
            lost.error = error_text(cast(contents.Error, msg.content))
        reply = cast(contents.Reply, msg.content)  # an error reply's has no status
        if msg.type == T.ERROR_REPLY and reply.get("ename") == SESSION_NOT_FOUND:
            self._settle(lost, "not run", "", "it reached the server after the server had ended the session")
        elif msg.type in TERMINAL:
            status = "error" if msg.type == T.ERROR_REPLY else str(reply.get("status", "ok"))
            self._settle(lost, "finished", status, lost.error or error_text(reply))

    def _ask_in_background(self) -> None:
        if any(not r.settled for r in self.lost.values()):
            threading.Thread(target=self._ask, name="genie-outcomes", daemon=True).start()

    def _ask(self) -> None:
        ids = [r.id for r in self.lost.values() if not r.settled]
        try:
            reply = self._outcomes(ids)
        except Exception as exc:
            if self.connection.session_gone:  # nobody can say any more
                why = (
                    f"the server ended the session and did not answer within {OUTCOME_TRIES * OUTCOME_WAIT:g} s"
                    if isinstance(exc, TimeoutError)
                    else "the server ended the session and no longer remembers it"  # it restarted
                )
                for lost in self.lost.values():
                    if not lost.settled:
                        self._settle(lost, "unknown", "", why)
            else:
                log.warning("could not learn the outcome of %d lost requests: %s", len(ids), exc)
            return
        for rid, outcome in cast(contents.OutcomeReply, reply.content).get("outcomes", {}).items():
            entry = self.lost.get(rid)
            if entry is None or entry.settled:
                continue
            state = outcome.get("state")
            if state == "finished":
                self._settle(entry, "finished", str(outcome.get("status", "")), str(outcome.get("error", "")))
            elif state == "not received":
                self._settle(entry, "not run", "", "")
            elif state == "stopped":
                self._settle(entry, "stopped", "", str(outcome.get("error", "")))
            else:
                entry.state = "running"  # its reply follows on this connection

    def _outcomes(self, ids: list[str]) -> Message:
        """The server's record of `ids`. Asked again after a timeout: a link that just healed may
        still be in TCP's retransmission backoff, and a wait of 10 s can end before it resends."""
        for attempt in range(1, OUTCOME_TRIES + 1):
            request = self.connection.request(Message(T.OUTCOME, contents.Outcome(ids=ids)))
            try:
                return request.wait(OUTCOME_WAIT)
            except TimeoutError:
                self.connection.forget(request)  # a late answer is then an orphan, not a leak
                if attempt == OUTCOME_TRIES:
                    raise
                log.info("no answer on the outcome of %d lost requests in %g s; asking again", len(ids), OUTCOME_WAIT)
        raise ValueError(f"OUTCOME_TRIES is {OUTCOME_TRIES}; it must be at least 1")

    def _settle(self, lost: LostRequest, state: str, status: str, error: str) -> None:
        lost.state, lost.status, lost.error, lost.settled = state, status, error, True
        severity = Severity.WARNING if state == "finished" else Severity.INFO if state == "not run" else Severity.ERROR
        self.emit(EventType.REQUEST_OUTCOME, severity, lost.describe(), request=lost.id, state=state, status=status)

    def take_settled(self) -> list[LostRequest]:
        """Lost requests whose fate is now known and not yet reported (each is returned once)."""
        done = [r for r in self.lost.values() if r.settled and not r.reported]
        for r in done:
            r.reported = True
        return done
