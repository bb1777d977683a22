"""Genie core runtime: reach GPUs on another machine as if they were local. No Jupyter imports.

state = genie_core.init_sync("gpu-box:5555", token="...")   # or: await genie_core.init(...)
state.client.execute("print('hi')").wait()
genie_core.shutdown_sync()
"""

from typing import Any

from .client import Client, ConnectOptions, Job, Request
from .client.pool import render_pool
from .cluster import (
    ClusterState,
    current_client,
    get_cluster_state,
    init,
    init_sync,
    is_initialized,
    shutdown,
    shutdown_sync,
)
from .config import ClusterConfig, parse_size
from .dataplane import BackendReport, BackendUnavailable, Candidate
from .errors import (
    AuthenticationError,
    ConfigError,
    ConnectionFailed,
    ConnectionLost,
    GenieError,
    LimitExceeded,
    NotInitializedError,
    RemoteError,
    VersionMismatch,
    WorkerDied,
)
from .events import ClusterEvent, EventBus, EventType, Severity
from .monitoring.health import Grade, HealthCheck, HealthReport
from .nodes import GPUInfo, NodeInfo
from .protocol import contents, remote_error
from .version import __version__

__all__ = [  # noqa: RUF022 - grouped by topic, in the order the docs present them
    "__version__",
    # connecting
    "init",
    "init_sync",
    "shutdown",
    "shutdown_sync",
    "is_initialized",
    "get_cluster_state",
    "ClusterConfig",
    "ClusterState",
    "Client",
    "ConnectOptions",
    "current_client",
    # what a session runs: a cell or request in flight, a background job
    "Request",
    "Job",
    # the data plane's choice
    "BackendReport",
    "BackendUnavailable",
    "Candidate",
    # events, readings and health
    "EventBus",
    "EventType",
    "ClusterEvent",
    "Severity",
    "NodeInfo",
    "GPUInfo",
    "HealthReport",
    "HealthCheck",
    "Grade",
    # errors
    "GenieError",
    "ConfigError",
    "ConnectionFailed",
    "AuthenticationError",
    "VersionMismatch",
    "ConnectionLost",
    "NotInitializedError",
    "RemoteError",
    "WorkerDied",
    "LimitExceeded",
    # what each message contains (a cell's outputs, as %%remote renders them), and the exception
    # a user's code raised on the server, from its error content
    "contents",
    "remote_error",
    # the text forms of `genie status`, `genie pool status` and `%genie_status --text`
    "render_status",
    "render_pool",
    "parse_size",
]


def __getattr__(name: str) -> Any:
    """`render_status` on first use: it brings in rich, which importing genie_core does not."""
    if name == "render_status":
        from .terminal import render

        return render
    raise AttributeError(f"module 'genie_core' has no attribute {name!r}")
