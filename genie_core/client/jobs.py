"""Background cells: `client.start_job(code)` returns a `Job` at once, and the notebook stays free.

The server numbers and keeps each job's output, so nothing is lost when the connection drops
and comes back, or when another client attaches to the session: a job follows its request's
replies live and, once cut off (or when it was started by an earlier client), asks the server
for what it has not seen yet.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from ..errors import ConnectionLost, GenieError, RemoteError
from ..protocol import TERMINAL, Message, MessageType, contents, remote_error
from .connection import Request

log = logging.getLogger("genie.client")

T = MessageType
POLL = 0.5  # seconds between asking the server, when a job is not followed live


class Job:
    """A cell running in the background on the session's worker (ipyparallel's AsyncResult, for cells).

    `state`: running, ok, error or stopped (the session ended under it). `output()` is its
    printed text so far, `tail()` the last lines, `outputs()` every output (rich ones too);
    `wait(timeout)`, `result(timeout)` and `cancel()` (an interrupt) as in concurrent.futures.
    """

    def __init__(
        self,
        ask: Callable[[dict[str, int]], list[contents.JobState]],
        interrupt: Callable[[str], None],
        gone: Callable[[], str],
        record: contents.JobState,
        request: Request | None,
    ) -> None:
        self._ask = ask  # since {id: first output wanted} -> the session's job records
        self._interrupt = interrupt  # request id -> an interrupt of it
        self._gone = gone  # why this client can no longer follow the job ("" while it can)
        self.id = str(record["id"])
        self.name = str(record["name"])
        self.summary = str(record.get("summary", ""))
        self.started = float(record.get("started") or time.time())
        self.ended: float | None = None
        self.state = "running"
        self.error = ""
        self.dropped = 0  # outputs the server let go (over its per-job limit)
        self._outputs: dict[int, tuple[str, Mapping[str, Any]]] = {}
        self._extra: list[tuple[str, Mapping[str, Any]]] = []  # outputs without a number (a cancellation's)
        self._done = threading.Event()
        self._stop = threading.Event()
        self.update(record)
        self._thread = threading.Thread(
            target=self._follow, args=(request,), name=f"genie-job-{self.name}", daemon=True
        )
        self._thread.start()

    # -- what the user asks ---------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ends (True) or `timeout` seconds pass (False)."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> str | None:
        """Wait for the job; its last expression's value as text (as Out[] shows it), or None.
        Raises the remote error if it failed, TimeoutError if it is still running after `timeout`."""
        if not self.wait(timeout):
            raise TimeoutError(f"job {self.name!r} is still running after {timeout:g} s")
        if self.state in ("stopped", "unknown"):
            raise ConnectionLost(f"job {self.name!r}: {self.error}")
        if self.state == "error":
            err = next((c for t, c in reversed(self.outputs()) if t == T.ERROR), None)
            if err is not None:
                raise remote_error(cast(contents.Error, err))
            name, _, value = self.error.partition(": ")
            raise RemoteError(name or "Error", value)
        found = next((c for t, c in reversed(self.outputs()) if t == T.EXECUTE_RESULT), None)
        return None if found is None else str(cast(contents.ExecuteResult, found).get("data", {}).get("text/plain", ""))

    def outputs(self) -> list[tuple[str, Mapping[str, Any]]]:
        """Every output kept so far, in order: (type, content) as a cell's outputs arrive."""
        return [self._outputs[n] for n in sorted(self._outputs)] + list(self._extra)

    def output(self) -> str:
        """Its printed text so far (stdout and stderr, in the order they came)."""
        return "".join(str(cast(contents.Stream, c).get("text", "")) for t, c in self.outputs() if t == T.STREAM)

    def tail(self, lines: int = 5) -> str:
        return "\n".join(self.output().rstrip("\n").splitlines()[-lines:])

    def cancel(self) -> None:
        """Interrupt it: KeyboardInterrupt in its code (or, queued, it never runs)."""
        self._interrupt(self.id)

    def __repr__(self) -> str:
        last = self.tail(1)
        return f"<Job {self.name!r}: {self.state}, {self.elapsed:.1f} s" + (f"; {last[-60:]!r}" if last else "") + ">"

    # -- keeping up --------------------------------------------------------------------------
    def _follow(self, request: Request | None) -> None:
        if request is not None:
            try:
                for msg in request.replies():
                    if msg.type not in TERMINAL:
                        self._add(msg)
                        continue
                    reply = cast(contents.ExecuteReply, msg.content)
                    if self._lacks(reply):
                        self.refresh()  # outputs the connection dropped on the way: the server has them
                    self._finish(reply)
                return
            except ConnectionLost:
                pass  # the server keeps its output: ask for it once it answers again
            except GenieError as exc:  # refused, or its worker died
                self._end("error", str(exc))
                return
        while not self._done.is_set() and not self._stop.is_set():
            gone = self._gone()
            if gone:
                self._end("unknown", f"no longer followed: {gone}")
                return
            try:
                self.refresh()
            except Exception as exc:  # not connected now: try again
                log.debug("job %s: %s", self.name, exc)
            self._stop.wait(POLL)

    def refresh(self) -> None:
        """Fetch from the server what this job has not seen (outputs, state)."""
        for record in self._ask({self.id: self._first_missing()}):
            if record.get("id") == self.id:
                self.update(record)

    def stop_following(self, why: str) -> None:
        """This client is going: a job still running is left to the server, and its waiters told."""
        self._stop.set()
        self._end("unknown", f"no longer followed: {why}")

    def _add(self, msg: Message) -> None:
        n = cast(contents.Output, msg.content).get("n")
        if isinstance(n, int):
            self._outputs[n] = (str(msg.type), msg.content)
        else:
            self._extra.append((str(msg.type), msg.content))

    def update(self, record: contents.JobState) -> None:
        """Take in a record from the server. It ends the job only with the outputs it has not seen
        (a record without them, as in a listing, is followed by a request for them)."""
        for n, kind, content in record.get("messages") or []:
            self._outputs.setdefault(int(n), (str(kind), dict(content)))
        self.dropped = int(record.get("dropped") or 0)
        state = str(record.get("state") or "running")
        if state == "running" or self._done.is_set():
            return
        if "messages" not in record and self._lacks(record):
            self.refresh()
        else:
            self._end(state, str(record.get("error") or ""), record.get("ended"))

    def _finish(self, content: contents.ExecuteReply) -> None:
        ok = content.get("status") == "ok"
        self._end(
            "ok" if ok else "error", "" if ok else f"{content.get('ename', 'Error')}: {content.get('evalue', '')}"
        )

    def _end(self, state: str, error: str, ended: Any = None) -> None:
        if self._done.is_set():
            return
        self.state, self.error = state, error
        self.ended = float(ended) if isinstance(ended, (int, float)) else time.time()
        self._done.set()

    def _lacks(self, said: contents.ExecuteReply | contents.JobState) -> bool:
        """Whether this job holds fewer outputs than the server says there were (`outputs`)."""
        return len(self._outputs) < int(said.get("outputs") or 0) - self.dropped

    def _first_missing(self) -> int:
        """The first output number not held, counting from the first the server still keeps."""
        n = min(self._outputs) if self._outputs else 0
        while n in self._outputs or n < self.dropped:  # below `dropped`: gone from the server too
            n += 1
        return n
