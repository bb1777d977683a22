"""Genie core runtime: reach GPUs on another machine as if they were local. No Jupyter imports."""

__version__ = "0.1.0"

from .cluster import ClusterState, get_cluster_state, init, init_sync, is_initialized, shutdown  # noqa: E402
from .config import ClusterConfig  # noqa: E402
from .dataplane import BackendReport, BackendUnavailable  # noqa: E402
from .errors import (  # noqa: E402
    AuthenticationError,
    ConfigError,
    ConnectionFailed,
    ConnectionLost,
    GenieError,
    LimitExceeded,
    NotInitializedError,
    RemoteError,
    WorkerDied,
)

__all__ = [
    "__version__",
    "init",
    "init_sync",
    "shutdown",
    "is_initialized",
    "get_cluster_state",
    "ClusterConfig",
    "ClusterState",
    "BackendReport",
    "BackendUnavailable",
    "GenieError",
    "LimitExceeded",
    "ConfigError",
    "ConnectionFailed",
    "AuthenticationError",
    "ConnectionLost",
    "NotInitializedError",
    "RemoteError",
    "WorkerDied",
]
