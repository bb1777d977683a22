"""The genie server: `Server` (to embed one) and `run_server` (what `genie serve` runs)."""

from .app import Server, run_server

__all__ = ["Server", "run_server"]
