"""The sandbox's command-line options, shared by `genie serve` and `genie pool up`."""

from __future__ import annotations

import argparse
from typing import Any


def add_sandbox_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--session-network",
        choices=("none", "outbound", "host"),
        default=None,
        help="sandboxed cells' network: none (loopback only), outbound (anywhere but this host's and the "
        "cluster's services; the default) or host (everything this host reaches)",
    )
    cmd.add_argument("--session-memory", default=None, metavar="SIZE", help="memory per sandboxed session, e.g. 16GiB")
    cmd.add_argument(
        "--session-processes", type=int, default=None, metavar="N", help="processes and threads per session (4096)"
    )
    cmd.add_argument("--session-cpus", type=float, default=None, metavar="N", help="CPU time per session, in CPUs")
    cmd.add_argument(
        "--allow-unisolated",
        action="store_true",
        default=None,
        help="start even where the sandbox cannot give every protection (each is listed at start)",
    )


def sandbox_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "session_network": args.session_network,
        "session_memory_bytes": args.session_memory,
        "session_processes": args.session_processes,
        "session_cpus": args.session_cpus,
        "allow_unisolated": args.allow_unisolated,
    }
