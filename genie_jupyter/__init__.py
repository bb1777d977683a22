"""Genie for Jupyter: `%load_ext genie_jupyter`, then `%genie_init` and `%%remote` cells."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from genie_core import __version__

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = [
    "BackendCard",
    "Dashboard",
    "EventLog",
    "GPUGauges",
    "HealthBadge",
    "InitProgress",
    "PoolDashboard",
    "__version__",
    "feed_for",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def __getattr__(name: str) -> Any:  # the widgets import anywidget: only when asked for
    if name in ("Dashboard", "GPUGauges", "HealthBadge", "BackendCard", "EventLog", "InitProgress", "PoolDashboard"):
        from . import widgets

        return getattr(widgets, name)
    if name == "feed_for":
        from .magics import feed_for

        return feed_for
    raise AttributeError(name)


def load_ipython_extension(ipython: InteractiveShell) -> None:
    from .magics import GenieMagics

    ipython.register_magics(GenieMagics)
    ipython.magics_manager.register_alias("genie_dashboard", "genie_status")


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    import genie_core

    genie_core.shutdown_sync()
