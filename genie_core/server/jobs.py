"""Background cells ("jobs") of a session, as the server keeps them: each one's output, numbered,
so that a client that was cut off, or a new client of the same session, can fetch what it missed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, cast

from ..protocol import TERMINAL, Message, MessageType, contents, error_text

T = MessageType
OUTPUT_BYTES = 4 << 20  # output kept per job; beyond it the oldest messages go (and are counted)
ENDED_KEPT = 32  # ended jobs a session remembers
TAIL_LINES = 5


class JobRecord:
    def __init__(self, request_id: str, name: str, code: str) -> None:
        self.id = request_id
        self.name = name
        first = next((line.strip() for line in code.splitlines() if line.strip()), "")
        self.summary = first if len(first) <= 60 else first[:57] + "..."
        self.started = time.time()
        self.ended: float | None = None
        self.state = "running"  # then ok, error or stopped
        self.error = ""
        self.messages: list[tuple[int, str, Mapping[str, Any]]] = []  # (n, type, content)
        self.next_n = 0
        self.bytes = 0
        self.dropped = 0  # messages let go to stay within OUTPUT_BYTES

    def add(self, msg: Message) -> None:
        """Keep one output (numbered in `content["n"]`, which the client sees too)."""
        cast(contents.Output, msg.content)["n"] = n = self.next_n
        self.next_n += 1
        size = len(str(msg.content))
        self.messages.append((n, str(msg.type), msg.content))
        self.bytes += size
        while self.bytes > OUTPUT_BYTES and len(self.messages) > 1:
            _, _, old = self.messages.pop(0)
            self.bytes -= len(str(old))
            self.dropped += 1

    def finish(self, content: contents.Failure) -> None:
        """Its last reply (an error reply has no status: error)."""
        if self.ended is not None:
            return
        self.ended = time.time()
        self.state = "ok" if cast(contents.Reply, content).get("status") == "ok" else "error"
        if content.get("ename"):
            self.error = error_text(content)

    def stop(self, why: str) -> None:
        if self.ended is None:
            self.ended, self.state, self.error = time.time(), "stopped", why[:500]

    def tail(self, lines: int = TAIL_LINES) -> str:
        streams = [cast(contents.Stream, c) for _, t, c in self.messages[-200:] if t == T.STREAM]
        text = "".join(str(c.get("text", "")) for c in streams)
        return "\n".join(text.rstrip("\n").splitlines()[-lines:])

    def to_dict(self, since: int | None = None) -> contents.JobState:
        """The record; with `since`, also the kept outputs numbered `since` and after."""
        out: contents.JobState = {
            "id": self.id,
            "name": self.name,
            "summary": self.summary,
            "started": self.started,
            "ended": self.ended,
            "state": self.state,
            "error": self.error,
            "outputs": self.next_n,
            "dropped": self.dropped,
            "tail": self.tail(),
        }
        if since is not None:
            out["messages"] = [[n, t, c] for n, t, c in self.messages if n >= since]
        return out


class Jobs:
    """A session's jobs, by request id: the running ones and the last ENDED_KEPT that ended."""

    def __init__(self) -> None:
        self.by_id: OrderedDict[str, JobRecord] = OrderedDict()
        self._count = 0

    def start(self, msg: Message) -> str:
        """Register an execute request that asked to run as a job; returns a problem, or ""."""
        execute = cast(contents.Execute, msg.content)
        name = str(execute.get("job") or "").strip()[:64]
        if not name:
            self._count += 1
            name = f"job-{self._count}"
            while any(j.name == name for j in self.by_id.values()):
                self._count += 1
                name = f"job-{self._count}"
        clash = next((j for j in self.by_id.values() if j.name == name and j.ended is None), None)
        if clash is not None:
            return (
                f"a job named {name!r} is still running (started {time.time() - clash.started:.0f} s ago): "
                "pick another --name, or wait for it or cancel it"
            )
        for old in [j for j in self.by_id.values() if j.name == name]:
            del self.by_id[old.id]  # an ended job of the same name: the new one replaces it
        self.by_id[msg.id] = JobRecord(msg.id, name, str(execute.get("code", "")))
        execute["job"] = name
        return ""

    def record(self, msg: Message) -> None:
        """An output from the worker: kept if it belongs to a job. Its reply carries how many
        outputs there were, so a client that missed some on the way asks for them."""
        job = self.by_id.get(msg.parent)
        if job is None:
            return
        if msg.type in TERMINAL:
            cast(contents.ExecuteReply, msg.content)["outputs"] = job.next_n  # (an error reply's too)
        else:
            job.add(msg)

    def finish(self, request_id: str, content: contents.Failure) -> None:
        job = self.by_id.get(request_id)
        if job is None:
            return
        job.finish(content)
        ended = [j.id for j in self.by_id.values() if j.ended is not None]
        for rid in ended[: max(0, len(ended) - ENDED_KEPT)]:  # the oldest first
            del self.by_id[rid]

    def running(self) -> list[JobRecord]:
        return [j for j in self.by_id.values() if j.ended is None]

    def stop_all(self, why: str) -> None:
        for job in self.running():
            job.stop(why)

    def report(self, since: dict[str, int]) -> list[contents.JobState]:
        """Every job; the outputs of those in `since` (request id -> first output number wanted)."""
        return [j.to_dict(since.get(j.id)) for j in self.by_id.values()]
