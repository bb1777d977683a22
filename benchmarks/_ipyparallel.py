"""One local ipyparallel cluster of one engine, the anchor of several benchmarks, started once per
run and stopped at exit: a start takes seconds (6.6 s on the 2-core VM, nearly all of it the
engine's own start), too long to pay in every benchmark that compares against it."""

from __future__ import annotations

import atexit
from typing import Any

_cluster: Any = None
_client: Any = None


def launch() -> None:
    """Start the controller and engine processes, without waiting for them (a quick run does this
    first, so that the engine starts while other benchmarks run). Nothing when not installed."""
    global _cluster
    try:
        import ipyparallel as ipp
    except ImportError:
        return
    if _cluster is None:
        _cluster = ipp.Cluster(n=1, log_level=40)
        _cluster.start_controller_sync()
        _cluster.start_engines_sync()
        atexit.register(stop)


def client() -> Any:
    """The shared cluster's client (an `ipyparallel.Client`), launched if it was not; None when
    ipyparallel is not installed."""
    global _client
    launch()
    if _cluster is not None and _client is None:
        _client = _cluster.connect_client_sync()
        _client.wait_for_engines(1, timeout=60)
    return _client


def stop() -> None:
    global _cluster, _client
    if _client is not None:
        _client.close()
    if _cluster is not None:
        _cluster.stop_cluster_sync()
    _cluster = _client = None
