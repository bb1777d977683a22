"""Discovery: every backend in the registry measured from this client to its server (within a
budget), the fastest chosen, and a report that says why, with every candidate's figures."""

from __future__ import annotations

import time
from collections import Counter

from .base import Backend, BackendReport, BackendUnavailable, Candidate, Channel, Found, Link, rate

# A backend measured within this factor of the fastest is measured once more, as is the fastest.
# Across two network namespaces on this 2-core VM one tcp probe measured 443 MB/s to 1.87 GiB/s from one
# session to the next (benchmarks/RESULTS.md, "Which backend across hosts").
SECOND_LOOK = 3.0


def discover(backends: list[Backend], link: Link, budget: float) -> tuple[BackendReport, Channel]:
    """Probe each backend in order; return the report and the chosen backend's open channel."""
    start = time.perf_counter()
    found: Found = {}
    requested = link.requested
    try:
        for backend in backends:
            found[backend.name] = backend.probe(link, budget, found)
        if requested == "auto":
            _second_look(backends, link, budget, found)
    except BaseException:
        _close_all(found, keep=None)
        raise
    candidates = [candidate for candidate, _ in found.values()]
    try:
        if requested != "auto":
            chosen = found.get(requested, (None, None))[0]
            if chosen is None or not chosen.available or found[requested][1] is None:
                why = chosen.reason if chosen else f"no such backend (known: {', '.join(found)})"
                raise BackendUnavailable(f"backend {requested!r} is unavailable: {why}")
            reason = f"{requested}: forced ({chosen.summary()})"
        else:
            usable = _usable(found)
            counted = _counted(backends, usable)
            chosen = max(usable, key=lambda c: counted[c.name])
            versus = ", ".join(_versus(c, usable, backends) for c in usable if c is not chosen)
            reason = f"{chosen.name}: {chosen.reason}, {rate(chosen.bandwidth or 0.0)}" + (
                f" vs {versus}" if versus else ""
            )
    except BaseException:
        _close_all(found, keep=None)
        raise
    channel = found[chosen.name][1]
    _close_all(found, keep=channel)
    assert channel is not None
    return BackendReport(chosen.name, reason, candidates, requested, time.perf_counter() - start), channel


def _discounted(backends: list[Backend], usable: list[Candidate]) -> dict[str, Backend]:
    """The backends whose rate the choice divides by their `margin`: those with a usable `rival`."""
    names = {c.name for c in usable}
    return {b.name: b for b in backends if b.rival in names and b.margin != 1}


def _counted(backends: list[Backend], usable: list[Candidate]) -> dict[str, float]:
    """Each usable backend's bandwidth as the choice counts it."""
    discounted = _discounted(backends, usable)
    return {c.name: (c.bandwidth or 0.0) / (discounted[c.name].margin if c.name in discounted else 1.0) for c in usable}


def _versus(candidate: Candidate, usable: list[Candidate], backends: list[Backend]) -> str:
    """A backend not chosen, as the report names it: its rate, and how the choice counted it."""
    said = f"{candidate.name} {rate(candidate.bandwidth or 0.0)}"
    backend = _discounted(backends, usable).get(candidate.name)
    return said if backend is None else f"{said} (counted at 1/{backend.margin:g} against {backend.rival})"


def _usable(found: Found) -> list[Candidate]:
    """The backends measured with an open channel: those the choice is between."""
    return [c for c, channel in found.values() if c.available and c.bandwidth and channel is not None]


def _second_look(backends: list[Backend], link: Link, budget: float, found: Found) -> None:
    """Measure the fastest backend and those within SECOND_LOOK of it once more, in the reverse
    order, each keeping its faster measurement (and that measurement's channel): a probe slowed by a
    moment's load (a process starting beside it, a server's slow start) does not decide alone. Load
    only ever slows a measurement, so the faster one is the path's own speed (base.best_time). A
    channel two backends share (rdma's is ucx's) is not measured again: it has no probe of its own."""
    counted = _counted(backends, _usable(found))
    fastest = max(counted.values(), default=0.0)
    holders = Counter(id(channel) for _, channel in found.values() if channel is not None)
    close = [
        name
        for name, bandwidth in counted.items()
        if bandwidth * SECOND_LOOK >= fastest and holders[id(found[name][1])] == 1  # (rdma uses ucx's)
    ]
    if len(close) < 2:
        return
    by_name = {backend.name: backend for backend in backends}
    for name in reversed(close):
        first, channel = found[name]
        again, other = by_name[name].probe(link, budget, found)
        measured = {"measured": [first.bandwidth, again.bandwidth if again.available else None]}
        to_close = other  # the slower measurement's channel
        if again.available and other is not None and (again.bandwidth or 0.0) > (first.bandwidth or 0.0):
            again.details = {**again.details, **measured}
            found[name] = (again, other)
            to_close = channel
        else:
            first.details = {**first.details, **measured}
        if to_close is not None:
            to_close.close()


def _close_all(found: Found, keep: Channel | None) -> None:
    for _, channel in found.values():
        if channel is not None and channel is not keep:
            channel.close()
