"""The one interface every data-plane backend implements, and what discovery reports.

A `Backend` has a server side (`offer`: start what clients need, say how to reach it) and a
client side (`probe`: measure it to this server and open a `Channel`). A `Channel` moves a list
of buffers to the server side (`put`, returning a reference the control message carries) and
back (`get`). The client, server and worker never ask which backend they have.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import GenieError
from ..protocol.contents import DataRef
from .stream import DataHost

# Bytes: transfers at least this big use the data plane; smaller ones travel inline. Set from
# benchmarks/tensor_bytes.py (a remote tensor's .to() and .cpu(), median of 21, both ways moved):
# the data plane wins from 64 KiB up on shared memory (6.1 against 11.5 ms up, 4.2 against 5.2 down)
# and for tcp uploads; tcp fetches of 64 to 256 KiB lose about 10% (5.6 against 5.1 ms). At 16 KiB
# inline wins on both (3.3 against 5.8 ms on shared memory).
DATA_THRESHOLD = 64 << 10
GIB = 1024**3


def rate(bps: float) -> str:
    return f"{bps / GIB:.2f} GiB/s" if bps >= GIB else f"{bps / 1e6:.1f} MB/s"


class BackendUnavailable(GenieError):
    """A backend was asked for by name and cannot be used here."""


@dataclass
class Candidate:
    """One backend as measured from this client: usable or not (and why), how fast."""

    name: str
    available: bool
    reason: str
    rtt_s: float | None = None
    bandwidth: float | None = None  # bytes per second, measured
    details: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.available:
            return f"{self.name}: unavailable ({self.reason})"
        bw = rate(self.bandwidth) if self.bandwidth else "not measured"
        rtt = f", {self.rtt_s * 1e3:.2f} ms round trip" if self.rtt_s is not None else ""
        return f"{self.name}: {bw}{rtt}"


@dataclass
class BackendReport:
    """The choice, why, and every candidate's measurements (or why it is unavailable)."""

    chosen: str
    reason: str
    candidates: list[Candidate]
    requested: str = "auto"
    elapsed_s: float = 0.0

    def candidate(self, name: str) -> Candidate:
        return next(c for c in self.candidates if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen,
            "reason": self.reason,
            "requested": self.requested,
            "elapsed_s": round(self.elapsed_s, 4),
            "candidates": [asdict(c) for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BackendReport:
        return cls(
            d["chosen"],
            d["reason"],
            [Candidate(**c) for c in d["candidates"]],
            d.get("requested", "auto"),
            d.get("elapsed_s", 0.0),
        )


class Channel:
    """An open data path to one server. `put` returns the reference a push carries (None: the
    bytes go inline in the control message); `get` fetches what a worker staged for a pull."""

    name = ""
    staged = True  # a pull's bytes are staged by the worker and fetched with `get`
    streams = False  # `get` goes through the server's data port, which sends bytes as they are staged

    def put(self, buffers: list[Any], progress: Any = None) -> DataRef | None:
        raise NotImplementedError

    def get(self, ref: DataRef, progress: Any = None) -> list[Any]:
        raise NotImplementedError

    def put_lent(self, buffers: list[Any], worker: int) -> DataRef | None:
        """As `put`, for bytes that `worker` (a GPU index) copies out and is done with once their
        request is answered: a channel may fill the same memory again then (`lent_to`)."""
        return self.put(buffers)

    def lent_to(self, ref: DataRef, request: Any) -> None:
        """The request that carries `ref` (from `put_lent`): its answer gives the memory back."""

    def discard(self, ref: DataRef) -> None:
        """A put whose push failed or was refused: free what it left."""

    def after(self) -> None:
        """A transfer is over (its reply arrived): prepare for the next one."""

    def close(self) -> None:
        pass


@dataclass
class ServerSide:
    """What a backend's server side needs from the server that offers it."""

    ip: str
    control_port: int
    fixed_port: bool  # the control port was asked for (not 0): data ports sit beside it
    data_port: int | None
    host: DataHost
    encrypted: bool
    enable_ucx: bool


@dataclass
class Link:
    """What a backend's client side needs to measure and open a path to one server."""

    host: str
    key: bytes
    session: str
    server: dict[str, Any]  # the server's "transport" info: what each backend offered
    data_port: int | None  # a tcp port given by the user (tunnels, relays), else the server's
    data_probe: Callable[[DataRef | None, bytes], None]  # a round trip on the control connection that
    #                                                             sends bytes inline or a reference to them
    ping: Callable[[], None]  # a round trip on the control connection (median_time times it)
    requested: str = "auto"


Found = dict[
    str, tuple[Candidate, "Channel | None"]
]  # the backends probed so far, by name: what each measured, its channel


class Backend:
    """One way to move bytes. Subclasses live one per module and are listed in `registry`."""

    name = ""
    slow_start = False  # its server side starts after the server is ready (a heavy import)
    # Chosen over the backend named `rival` (when that one is usable) only if measured `margin`
    # times as fast: for a backend whose probe flatters it against that one (ucx against tcp).
    rival = ""
    margin = 1.0

    def offer(self, side: ServerSide) -> dict[str, Any]:
        """Server: start what clients need; return what they need to know (transport info)."""
        return {}

    def stop(self) -> None:
        """Server: stop what `offer` started."""

    def probe(self, link: Link, budget: float, found: Found) -> tuple[Candidate, Channel | None]:
        """Client: measure this backend to the server within `budget` seconds and open a channel
        (None when unavailable). `found` holds the backends probed before this one."""
        raise NotImplementedError


def median_time(fn: Callable[[], Any], n: int) -> float:
    return statistics.median(_timed(fn) for _ in range(n))


def best_time(fn: Callable[[], Any], n: int) -> float:
    """The shortest of n runs of a transfer probe: load only ever slows a run down, so the fastest
    is the path's own speed, and a probe preempted in most of its runs (a busy machine) does not
    lose a backend the choice."""
    return min(_timed(fn) for _ in range(n))


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def probe_size(rate_guess: float, budget: float) -> int:
    """A transfer that takes about a quarter of the budget at the guessed rate (64 KiB..64 MiB)."""
    return int(min(64 << 20, max(64 << 10, rate_guess * budget / 4)))


def measure_stream(channel: Any, budget: float) -> tuple[float, float]:
    """Round trip (median of 10 pings) and bandwidth (a sink sized to the budget, the best of two) of
    a stream backend: a small send guesses the rate, then a transfer of about a quarter of the budget."""
    rtt = median_time(channel.ping, 10)
    first = memoryview(bytearray(256 << 10))
    guess = len(first) / max(channel.sink(first), 1e-6)
    payload = memoryview(bytearray(min(32 << 20, probe_size(guess, budget))))
    return rtt, len(payload) / min(channel.sink(payload) for _ in range(2))
