"""The `genie` command: `genie serve` runs a server; `genie status` and `genie top` watch one.
Other packages add commands through the `genie.commands` entry point group (genie_jupyter adds
`genie demo`), so this core package never imports them."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points
from typing import Any

from .config import ClusterConfig
from .errors import GenieError
from .sandbox.options import add_sandbox_options, sandbox_settings


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range (0..65535; 0 picks a free port)")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line, not argparse's usage block: what is wrong, and where the help is."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="genie", description="Remote GPUs that feel local, from a notebook.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a genie server on this (GPU) machine")
    serve.add_argument("--ip", default=None, help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=None, help="port (default 5555; 0 picks a free one)")
    serve.add_argument("--token", default=None, help="shared secret (default: $GENIE_TOKEN, else generated)")
    serve.add_argument(
        "--encrypt",
        action="store_true",
        default=None,
        help="encrypt with CurveZMQ; clients need the connection file, which holds the keys",
    )
    serve.add_argument(
        "--max-session-tensors",
        type=int,
        default=None,
        metavar="N",
        help="remote tensors one session may hold (default 1,000,000)",
    )
    serve.add_argument(
        "--max-session-bytes",
        default=None,
        metavar="SIZE",
        help="bytes of remote tensors one session may hold, and its largest push, e.g. 40GiB (default: no limit)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end a session that has had no client and nothing running for this long, after a warning event "
        "(default: never; sessions without a name end when their client goes anyway)",
    )
    serve.add_argument("--gpus", default=None, help="GPU indices to offer, e.g. 0,1 (default: all)")
    serve.add_argument(
        "--sandbox",
        action="store_true",
        default=None,
        help="run each session's worker in a sandbox of its own (for a server shared by several people)",
    )
    add_sandbox_options(serve)
    serve.add_argument("--node-id", default=None, help="name of this node (default: host name)")
    serve.add_argument("--connection-file", default=None, help="where to write the connection file")
    serve.add_argument("--lifeline-fd", type=int, default=None, help=argparse.SUPPRESS)  # see LocalServer
    serve.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default: $GENIE_LOG_LEVEL)")
    serve.add_argument(
        "--poll-interval", type=float, default=None, help="seconds between GPU/host readings (default 1)"
    )
    serve.add_argument("--no-monitoring", action="store_true", help="do not poll GPUs and the host")
    serve.add_argument(
        "--no-ucx",
        action="store_true",
        help="no UCX listener (starting one costs a second of CPU; clients on this host use shm anyway)",
    )
    serve.add_argument(
        "--simulate-gpus",
        type=int,
        default=None,
        metavar="N",
        help="report N simulated GPUs (labelled as fake) instead of reading NVML: for demos and tests without a GPU",
    )

    _add_pool_commands(sub)

    for name, text in (
        ("status", "print one report of a server: node, GPUs, health, sessions, events"),
        ("top", "a live terminal dashboard of a server"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("address", nargs="?", default=None, help="host[:port] (default: the newest local server)")
        cmd.add_argument("--token", default=None, help="the server's token (else $GENIE_TOKEN or its connection file)")
        cmd.add_argument("--connection-file", default=None)
        if name == "status":
            cmd.add_argument("--json", action="store_true", help="machine-readable output")
        else:
            cmd.add_argument("--iterations", type=int, default=None, help="stop after N updates")

    for entry in entry_points(group="genie.commands"):
        try:
            add_command = entry.load()
        except Exception as exc:  # a broken plugin must not break `genie serve`
            logging.getLogger("genie").warning(
                "the genie command %r from %s could not load: %s", entry.name, entry.value, exc
            )
            continue
        command = add_command(sub)  # adds its subparser; returns the function that runs it
        command_parser = sub.choices[entry.name]
        command_parser.set_defaults(run=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "pool":
            from .pool.commands import run

            return run(args)
        if args.command == "status":
            from .terminal import status

            return status(args.address, args.token, args.connection_file, args.json)
        if args.command == "top":
            from .terminal import top

            return top(args.address, args.token, args.connection_file, args.iterations)
        if getattr(args, "run", None) is not None:
            return int(args.run(args))
    except GenieError as exc:
        print(f"genie: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `genie status --json | head`
        sys.stderr.close()
        return 0
    return 1


def _serve(args: argparse.Namespace) -> int:
    from .server import run_server

    config = ClusterConfig.resolve(
        node_role="server",
        ip=args.ip,
        master_port=args.port,
        token=args.token,
        gpus=args.gpus,
        node_id=args.node_id,
        connection_file=args.connection_file,
        log_level=args.log_level,
        gpu_poll_interval=args.poll_interval,
        enable_gpu_monitoring=False if args.no_monitoring else None,
        simulate_gpus=args.simulate_gpus,
        encrypt=args.encrypt,
        max_session_tensors=args.max_session_tensors,
        max_session_bytes=args.max_session_bytes,
        enable_ucx=False if args.no_ucx else None,
        idle_timeout=args.idle_timeout,
        sandbox=args.sandbox,
        **sandbox_settings(args),
    )
    logging.basicConfig(level=config.log_level.upper(), format="[genie %(levelname)s] %(message)s")
    return run_server(config, parent_lifeline=args.lifeline_fd)


def _add_pool_commands(sub: Any) -> None:
    pool = sub.add_parser("pool", help="a pool of GPU machines run by Ray, shared by several users")
    pool_sub = pool.add_subparsers(dest="pool_command", required=True)
    db_help = "the registry: sqlite:///PATH or postgresql://... (default: SQLite in the state directory)"
    up = pool_sub.add_parser("up", help="run the pool's endpoint, where notebooks ask for GPUs")
    up.add_argument("--ray-address", default=None, help="a running Ray cluster (default: start a local head)")
    up.add_argument("--db", default=None, help=db_help)
    up.add_argument("--ip", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    up.add_argument("--port", type=_port, default=5555, help="port (default 5555; 0 picks a free one)")
    up.add_argument(
        "--simulate-gpus",
        type=int,
        default=None,
        metavar="N",
        help="declare N GPUs on the local head, with simulated readings labelled as fake (no GPU needed)",
    )
    up.add_argument(
        "--idle-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="end a session with no client and nothing running for this long, after a warning (default: never)",
    )
    up.add_argument(
        "--queue-timeout", type=float, default=600.0, metavar="SECONDS", help="longest wait in the queue (600)"
    )
    up.add_argument(
        "--no-warm-sessions",
        dest="warm_sessions",
        action="store_false",
        help="keep no warm session on each node (by default each node keeps one, holding a GPU for the next "
        "one-GPU user, who then skips the seconds Ray takes to start an actor)",
    )
    add_sandbox_options(up)  # sessions are always sandboxed in a pool
    pool_sub.add_parser("down", help="stop the local Ray head that `genie pool up` started (ends its sessions)")
    user = pool_sub.add_parser("user", help="users of the pool and their quotas")
    user_sub = user.add_subparsers(dest="user_command", required=True)
    for name, text in (("add", "add a user and print their token"), ("token", "give a user a new token")):
        cmd = user_sub.add_parser(name, help=text)
        cmd.add_argument("name", help="the user's name (letters, digits, . _ -)")
        cmd.add_argument("--db", default=None, help=db_help)
        if name == "add":
            cmd.add_argument("--max-gpus", type=int, default=None, help="GPUs at once (default: no limit)")
            cmd.add_argument("--max-sessions", type=int, default=None, help="sessions at once (default: no limit)")
            cmd.add_argument(
                "--gpu-hours-per-day", type=float, default=None, help="GPU-hours in any 24 hours (default: no limit)"
            )
    for name, text in (
        ("status", "nodes, their health, each GPU's reading and who holds it, and the queue"),
        ("top", "the same, redrawn each second"),
    ):
        cmd = pool_sub.add_parser(name, help=text)
        cmd.add_argument("address", help="the pool's host:port")
        cmd.add_argument("--token", default=None, help="a pool token (else $GENIE_TOKEN)")
        if name == "status":
            cmd.add_argument("--json", action="store_true", help="machine-readable output")
        else:
            cmd.add_argument("--iterations", type=int, default=None, help="stop after N updates")
