"""Staged segments that their worker is still filling, for the data port that sends them.

A client that fetches through the server's data port (tcp, ucx) gets a reply as soon as the
worker has taken a segment for the bytes; the worker then copies them in part by part and says how
far it got (a `staging` message, read on the server's loop thread). The data port's thread sends
each part once it is there, so the copy and the network overlap, where a segment filled before
the reply would add the whole copy to the wait (benchmarks/RESULTS.md, across_hosts).
"""

from __future__ import annotations

import functools
import threading

from .segment import Segment, creator_pid

STALL = 60.0  # seconds a worker may go without filling more before the transfer fails
KEPT_FAILED = 64  # fillings whose worker died before they were fetched, kept to say so


class Filling:
    """One segment being filled (`name`, for `session`): how many bytes are in, or why no more
    will come."""

    def __init__(self, name: str, session: str, total: int, reusable: bool = False) -> None:
        self.name, self.session, self.total = name, session, total
        self.reusable = reusable  # its worker fills it again once it has been sent (Segment.send_back)
        self.worker_gone = False
        self.filled = 0
        self.ename, self.evalue = "", ""
        self._changed = threading.Condition()

    def advance(self, filled: int) -> None:
        with self._changed:
            self.filled = max(self.filled, min(int(filled), self.total))
            self._changed.notify_all()

    def fail(self, ename: str, evalue: str, worker_gone: bool = False) -> None:
        with self._changed:
            if not self.ename and self.filled < self.total:
                self.ename, self.evalue = ename, evalue[:4000]
            self.worker_gone = self.worker_gone or worker_gone
            self._changed.notify_all()

    def wait_for(self, end: int, stall: float = STALL) -> None:
        """Return once the first `end` bytes are in, or the filling failed (then `outcome` says so):
        a worker that fills nothing more for `stall` seconds has failed it."""
        with self._changed:
            while self.filled < end and not self.ename:
                if not self._changed.wait_for(functools.partial(self._moved, self.filled), stall):
                    self.ename, self.evalue = "TimeoutError", f"the worker staged nothing more for {stall:g} s"

    def _moved(self, since: int) -> bool:
        return self.filled != since or bool(self.ename)

    def ready(self, end: int) -> bool:
        """Whether the first `end` bytes are in (or no more will come): no wait needed."""
        with self._changed:
            return self.filled >= end or bool(self.ename)

    def outcome(self) -> dict[str, object]:
        """The trailer a data port sends after the payload: whether every byte was the worker's."""
        with self._changed:
            if self.ename:
                return {"ok": False, "ename": self.ename, "evalue": self.evalue}
            return {"ok": self.filled >= self.total}

    def sent(self) -> None:
        """Its data port has sent all of it: back to its worker, if that is still there (once a
        worker is gone its segments are swept, and a name given back after that would stay)."""
        with self._changed:
            if self.reusable and not self.worker_gone and self.filled >= self.total and not self.ename:
                Segment.send_back(self.name)


class Fillings:
    """The server's segments being filled: by name (a data port takes the one it sends, for its
    session only) and by worker (a worker fills one at a time, and its `staging` messages name no
    segment)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, Filling] = {}
        self._by_worker: dict[int, Filling] = {}

    def begin(self, pid: int, name: str, total: int, session: str, reusable: bool) -> None:
        """Worker `pid` has staged segment `name` for `session` and fills it now (its reply went out
        first); `reusable`: the worker takes it back once sent, to fill again. A name the worker
        did not make (`genie-w-PID-...`, its pid) is ignored: its fetch then finds no such data."""
        if creator_pid(name) != pid or not name.startswith("genie-w-"):
            return
        filling = Filling(name, session, total, reusable)
        with self._lock:
            old = self._by_worker.pop(pid, None)
            if old is not None:  # never fetched, and the worker has removed it since
                self._by_name.pop(old.name, None)
            self._by_worker[pid] = self._by_name[name] = filling

    def advance(self, pid: int, filled: int, ename: str = "", evalue: str = "") -> None:
        """Worker `pid` says how far it has filled its segment, or (`ename`) why it stopped."""
        with self._lock:
            filling = self._by_worker.get(pid)
        if filling is None:
            return
        if ename:
            filling.fail(ename, evalue)
        else:
            filling.advance(filled)

    def worker_gone(self, pid: int, why: str) -> None:
        """Worker `pid` has ended: what it was filling will not be filled (a fetch of it, even one
        that comes later, says so; the last KEPT_FAILED such are kept)."""
        with self._lock:
            filling = self._by_worker.pop(pid, None)
            if filling is not None:
                if filling.filled >= filling.total:
                    self._by_name.pop(filling.name, None)
                filling.fail("WorkerDied", why, worker_gone=True)
            failed = [f for f in self._by_name.values() if f.worker_gone]
            for old in failed[: max(0, len(failed) - KEPT_FAILED)]:
                self._by_name.pop(old.name, None)

    def take(self, name: str, session: str) -> Filling | None:
        """The filling of segment `name` if it is for `session`, for the data port that sends it
        (None: none, or it was full before its reply went out)."""
        with self._lock:
            filling = self._by_name.get(name)
            if filling is None or filling.session != session:
                return None
            del self._by_name[name]
            return filling
