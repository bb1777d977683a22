"""Discovery: every backend in the registry measured from this client to its server (within a
budget), the fastest chosen, and a report that says why, with every candidate's figures."""

from __future__ import annotations

import time

from .base import Backend, BackendReport, BackendUnavailable, Candidate, Channel, Link, rate


def discover(backends: list[Backend], link: Link, budget: float) -> tuple[BackendReport, Channel]:
    """Probe each backend in order; return the report and the chosen backend's open channel."""
    start = time.perf_counter()
    found: dict[str, tuple[Candidate, Channel | None]] = {}
    for backend in backends:
        found[backend.name] = backend.probe(link, budget, found)
    candidates = [candidate for candidate, _ in found.values()]
    requested = link.requested
    try:
        if requested != "auto":
            chosen = found.get(requested, (None, None))[0]
            if chosen is None or not chosen.available or found[requested][1] is None:
                why = chosen.reason if chosen else f"no such backend (known: {', '.join(found)})"
                raise BackendUnavailable(f"backend {requested!r} is unavailable: {why}")
            reason = f"{requested}: forced ({chosen.summary()})"
        else:
            usable = [c for c in candidates if c.available and c.bandwidth and found[c.name][1] is not None]
            chosen = max(usable, key=lambda c: c.bandwidth or 0.0)
            versus = ", ".join(f"{c.name} {rate(c.bandwidth or 0.0)}" for c in usable if c is not chosen)
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


def _close_all(found: dict[str, tuple[Candidate, Channel | None]], keep: Channel | None) -> None:
    for _, channel in found.values():
        if channel is not None and channel is not keep:
            channel.close()
