"""`genie pool up | user add | user token | status`: what an admin and a user type in a terminal."""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..config import state_dir
from ..errors import ConfigError
from ..protocol import pool as wire
from ..sandbox.options import sandbox_settings
from .registry import Registry

USER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def default_db() -> str:
    return f"sqlite:///{state_dir('pool') / 'registry.sqlite'}"


def new_user_token(name: str) -> str:
    """A pool token: the user's name, a colon, a secret. The name tells a pool which key to check."""
    return f"{name}:{secrets.token_urlsafe(24)}"


def run(args: argparse.Namespace) -> int:
    if args.pool_command == "up":
        return _up(args)
    if args.pool_command == "user":
        return _user(args)
    if args.pool_command == "down":
        return _down(args)
    return _status(args)


def _user(args: argparse.Namespace) -> int:
    if not USER_NAME.match(args.name):
        raise ConfigError(f"invalid user name {args.name!r}: letters, digits, '.', '_' and '-' only")
    registry = Registry(args.db or default_db())
    token = new_user_token(args.name)
    try:
        if args.user_command == "add":
            registry.add_user(
                args.name, wire.stored_key(token), args.max_gpus, args.max_sessions, args.gpu_hours_per_day
            )
        else:
            if registry.user(args.name) is None:
                raise ConfigError(f"no user {args.name!r}: `genie pool user add {args.name}` adds them")
            registry.set_key(args.name, wire.stored_key(token))
            registry.event("token_changed", args.name, None, {})
    finally:
        registry.close()
    print(token)  # only printed, never stored: the registry keeps a key derived from it
    return 0


def _up(args: argparse.Namespace) -> int:
    from .head import LOCAL_ONLY, RAY_START_HEALTH_CHECKS, local_auth, node_loss_seconds, start_local_head

    head = _head_file()
    known = _running_head(head) if args.ray_address is None else None
    if args.ray_address is None:  # read when ray is imported, and by the head's processes
        os.environ.update(LOCAL_ONLY)
        if known is None or known.get("auth") == "token":  # (a head started before genie gave it a token has none)
            os.environ.update(local_auth(head.with_name("ray-auth-token")))

    from .endpoint import Pool

    address = args.ray_address
    if address is None:  # the local head an earlier `up` started, else a new one
        if known is not None:
            address = known["address"]
        else:
            began = time.monotonic()
            _progress("starting a local Ray head")
            address, folder = start_local_head(args.simulate_gpus or 0)
            head.write_text(json.dumps({"address": address, "folder": folder, "auth": "token"}))
            _progress(f"a local Ray head at {address} started in {time.monotonic() - began:.1f} s")
    _progress(f"joining Ray at {address}")
    pool = Pool(
        ray_address=address,
        db=args.db or default_db(),
        ip=args.ip,
        port=args.port,
        simulate_gpus=bool(args.simulate_gpus),
        idle_timeout=args.idle_timeout,
        queue_timeout=args.queue_timeout,
        warm_sessions=args.warm_sessions,
        isolation={k: v for k, v in sandbox_settings(args).items() if v is not None},
    ).start()
    free = pool.status()
    print(
        f"genie pool at {pool.ip}:{pool.port}: {len([n for n in free['nodes'] if n['alive']])} node(s), "
        f"{free['total']} GPU(s), {len(pool.sessions)} running session(s); registry {pool.registry.kind}",
        flush=True,
    )
    if pool.protections:
        print("sessions' sandbox:\n" + "\n".join(f"  {p.line()}" for p in pool.protections), flush=True)
    seconds, how = node_loss_seconds()
    print(
        f"a node that dies is noticed in about {seconds:.0f} s ({how})"
        + (f"; for about 3 s start Ray's head with {RAY_START_HEALTH_CHECKS}" if seconds > 5 else ""),
        flush=True,
    )
    # A stop by a service manager is a Ctrl-C: the warm sessions end (each holds a GPU), sessions go on.
    signal.signal(signal.SIGTERM, lambda signum, frame: pool.stop())
    try:
        pool.serve_forever()
    except KeyboardInterrupt:
        pass
    print("genie pool stopped (running sessions go on; `genie pool up` again finds them)", flush=True)
    return 0


def _progress(line: str) -> None:
    """Where `genie pool up` is, on stderr: a start that takes long shows which step it is in."""
    print(f"[genie pool] {line}", file=sys.stderr, flush=True)


def _head_file() -> Path:
    return state_dir("pool") / "local-head.json"


def _running_head(head: Path) -> dict[str, Any] | None:
    """The record of the local head an earlier `up` started, if its files are still there."""
    if not head.exists():
        return None
    known: dict[str, Any] = json.loads(head.read_text())
    return known if Path(known["folder"]).is_dir() else None


def _down(args: argparse.Namespace) -> int:
    """End the local Ray head that `genie pool up` started, and with it every session on it."""
    from .head import stop_local_head

    head = _head_file()
    if not head.exists():
        print("no local Ray head was started by `genie pool up` (a cluster of your own: `ray stop` on its nodes)")
        return 1
    known = json.loads(head.read_text())
    ended = stop_local_head(known["folder"])
    head.unlink()
    print(f"stopped the local Ray head at {known['address']} ({ended} processes)")
    return 0


def _status(args: argparse.Namespace) -> int:
    """`genie pool status` once, or `genie pool top`: redrawn each second."""
    from ..client.pool import PoolClient, render_pool
    from ..config import parse_address

    host, port = parse_address(args.address, 5555)
    token = args.token or os.environ.get("GENIE_TOKEN", "")
    session = PoolClient(host, port or 5555, token)
    try:
        if args.pool_command == "status":
            report = session.status()
            print(json.dumps(report, indent=1) if args.json else render_pool(report))
            return 0
        shown = 0
        while args.iterations is None or shown < args.iterations:
            text = render_pool(session.status())
            print(
                "\x1b[H\x1b[2J" + f"genie pool at {session.address}  {time.strftime('%H:%M:%S')}\n" + text, flush=True
            )
            shown += 1
            time.sleep(1.0)
    finally:
        session.close()
    return 0
