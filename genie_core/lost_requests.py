"""Requests cut off by a lost connection, and what the client learns of them afterwards.

Each request that acts on the worker runs at most once; when the server answers again, the
client asks what became of the cut-off ones (see `Client._ask_outcomes`) and keeps the answer here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

KEEP_OUTPUT = 64 << 10  # characters of a lost cell's late output kept to show


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
        what = f"{'the cell' if self.type == 'execute' else 'the ' + self.type} sent at {time.strftime('%H:%M:%S', time.localtime(self.lost_at))}"
        what += f" ({self.summary})" if self.summary else ""
        if self.state == "finished":
            return f"{what} ran on the server after all and finished {self.status}" + (f" ({self.error})" if self.error else "")
        if self.state == "stopped":
            return f"{what} was running on the server and was {self.error}"
        if self.state == "not run":
            return f"{what} did not run: {self.error or 'it never reached the server'}"
        if self.state == "running":
            return f"{what} is still running on the server"
        return f"{what}: unknown whether it ran" + (f" ({self.error})" if self.error else "")
