"""The genie server and its per-session worker processes."""

from .server import Server, run_server

__all__ = ["Server", "run_server"]
