"""The data plane: how tensor and array bytes move between a client and its server, beside the
control connection. One `Backend` interface, one module per backend, and this registry, which
the server (to offer them) and discovery (to measure them) both iterate. Adding a backend is
one module and one line here."""

from __future__ import annotations

from .base import DATA_THRESHOLD, Backend, BackendReport, BackendUnavailable, Candidate, Channel, Link, ServerSide
from .discovery import discover
from .hardware import Dpdk, GpuDirect, Rdma
from .shm import Shm
from .tcp import Tcp
from .ucx import Ucx
from .zmq import InlineChannel, Zmq

REGISTRY: list[type[Backend]] = [Shm, Tcp, Zmq, Ucx, Rdma, Dpdk, GpuDirect]  # the order reports list them in


def backends() -> list[Backend]:
    """A fresh instance of each backend, in registry order."""
    return [cls() for cls in REGISTRY]


__all__ = [
    "DATA_THRESHOLD",
    "REGISTRY",
    "Backend",
    "BackendReport",
    "BackendUnavailable",
    "Candidate",
    "Channel",
    "InlineChannel",
    "Link",
    "ServerSide",
    "backends",
    "discover",
]
