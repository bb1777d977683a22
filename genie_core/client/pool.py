"""A client's side of a GPU pool: ask `genie pool up` for a session, wait in its queue, and hear
when the session is lost (its node left). Cells then go to the session's own server.

A pool token reads `user:secret` (`genie pool user add NAME` prints it); that form tells a pool
from a single genie server.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..errors import AuthenticationError, ConfigError, ConnectionFailed, GenieError
from ..protocol import pool as wire

log = logging.getLogger("genie.pool")

WATCH_EVERY = 1.0  # seconds between keep-alives that tell the pool where this client is


class PlacementFailed(GenieError):
    """The pool could not give a session: a quota, no such GPUs, or the queue's timeout."""


def is_pool_token(token: str | None) -> bool:
    user, colon, secret = (token or "").partition(":")
    return bool(colon and user and secret)


class PoolClient:
    """One placement request and, once placed, the keep-alive that hears about the session."""

    def __init__(self, host: str, port: int, token: str, timeout: float = 30.0) -> None:
        if not is_pool_token(token):
            raise ConfigError("a pool token reads user:secret (printed by `genie pool user add NAME`)")
        self.address = f"{host}:{port}"
        self._host, self._port = host, port
        self.user, _, _ = token.partition(":")
        self._token = token
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.connect(f"tcp://{host}:{port}")
        self.session_id = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _request(self, op: str, **args: Any) -> tuple[str, bytes]:
        request, key = wire.sign_request(self.user, self._token, op, **args)
        self._sock.send(json.dumps(request).encode())
        return request["id"], key

    def _receive(self, request_id: str, key: bytes, timeout: float) -> dict[str, Any]:
        """The next genuine reply to this request (others, and forgeries, are dropped)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000) + 1):
                break
            try:
                reply = json.loads(self._sock.recv())
            except ValueError:
                continue
            if reply.get("kind") == "refused" and reply.get("re") == request_id:
                raise AuthenticationError(
                    f"the pool at {self.address} does not know user {self.user!r} with this token "
                    "(`genie pool user add` prints a user's token)"
                )
            if reply.get("re") == request_id and wire.reply_is_genuine(reply, key):
                return dict(reply)
        raise ConnectionFailed(f"no answer from the genie pool at {self.address} within {timeout:.0f} s")

    def place(
        self,
        gpus: int,
        name: str = "",
        wait: float = 600.0,
        on_wait: Callable[[str], None] | None = None,
        accelerator: str = "",
    ) -> dict[str, Any]:
        """Ask for a session with `gpus` GPUs; block (calling `on_wait` as the queue moves) until it
        is placed. Returns where its server is, with its token unsealed. A failure or an interrupt
        while waiting leaves the queue (or ends the session, if it was placed meanwhile)."""
        request_id, key = self._request("place", gpus=gpus, name=name, wait=wait, accelerator=accelerator)
        deadline = time.monotonic() + wait + self.timeout
        try:
            reply = self._receive(request_id, key, self.timeout)
            while reply["kind"] in ("asked", "queued"):
                self.session_id = str(reply.get("session", ""))
                if reply["kind"] == "queued" and on_wait is not None:
                    on_wait(
                        f"waiting for {gpus} GPU(s): {int(reply['ahead'])} session(s) ahead of you; "
                        f"{reply['free']} of {reply['total']} GPUs free"
                    )
                reply = self._receive(request_id, key, max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.cancel()
            raise
        if reply["kind"] == "error":
            raise PlacementFailed(f"the pool at {self.address}: {reply['error']}")
        if reply["kind"] != "placed":
            raise PlacementFailed(f"the pool at {self.address} answered {reply['kind']!r}")
        reply["token"] = wire.unseal(str(reply["token"]), key, request_id)
        self.session_id = str(reply["session"])
        return reply

    def cancel(self, timeout: float = 2.0) -> None:
        """Leave the queue, or end the session the pool placed for us; waits (briefly) for the
        pool to confirm, so the request is not lost with the socket."""
        if not self.session_id:
            return
        try:
            request_id, key = self._request("end", session=self.session_id)
            self._receive(request_id, key, timeout)
        except (GenieError, zmq.ZMQError) as exc:
            log.warning("could not tell the pool at %s to end session %s: %s", self.address, self.session_id, exc)

    def status(self) -> dict[str, Any]:
        """The pool now: nodes, their GPUs and who holds them, the queue. On a socket of its own,
        so any thread may ask while the keep-alive runs."""
        other = self.copy()
        try:
            return other.ask_status()
        finally:
            other.close()

    def copy(self) -> PoolClient:
        """A client of the same user, for another thread (a socket belongs to one)."""
        return PoolClient(self._host, self._port, self._token, timeout=self.timeout)

    def ask_status(self) -> dict[str, Any]:
        """`status`, on this client's own socket: for a client one thread keeps for asking it again
        and again (the pool dashboard's feed: one connection however long it runs)."""
        request_id, key = self._request("status")
        return self._receive(request_id, key, self.timeout)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """From now on, keep telling the pool where this client is, and call `on_lost(reason)` if
        the pool says the session is lost. The socket is this thread's from here on."""

        def run() -> None:
            last = 0.0
            while not self._stop.is_set():
                if time.monotonic() - last >= WATCH_EVERY:
                    self._request("watch", sessions=[self.session_id])
                    last = time.monotonic()
                if not self._sock.poll(100):
                    continue
                try:
                    reply = json.loads(self._sock.recv())
                except ValueError:
                    continue
                if (
                    reply.get("kind") == "session_lost"
                    and reply.get("session") == self.session_id
                    and wire.reply_is_genuine(reply, wire.client_key(self._token))
                ):
                    on_lost(str(reply.get("reason", "the pool lost it")))
                    return

        self._thread = threading.Thread(target=run, name="genie-pool-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2)
        self._sock.close()
        self._ctx.term()


def render_pool(report: dict[str, Any]) -> str:
    """The pool as text: a line a node (its health), a line a GPU (its reading and who holds it),
    then the queue."""
    lines = [f"{report['free']} of {report['total']} GPUs free"]
    for node in report["nodes"]:
        if not node["alive"]:
            health = "dead"
        elif not node["gpus"]:
            health = "no GPUs: nothing is placed here (Ray's head, or a CPU node)"
        else:
            health = (node.get("health") or {}).get("grade", "no reading yet")
        fake = "  (simulated GPUs: fake readings)" if node.get("simulated") else ""
        lines.append(f"{node['name']:<24} {node['ip']:<15} {node['gpus']} GPU(s)  {health}{fake}")
        lines += [f"    ! {reason}" for reason in (node.get("health") or {}).get("reasons", [])]
        holder = {gpu: s for s in node["sessions"] for gpu in s["gpu_ids"]}
        readings = {str(g["index"]): g for g in node.get("gpu_readings") or []}
        warm = set(node.get("warm", []))  # a warm session holds it for the next user
        for gpu in sorted(set(readings) | set(holder) | warm, key=lambda g: (len(g), g)):
            g, held = readings.get(gpu, {}), holder.get(gpu)
            used = f"{_gib(g.get('memory_used'))}/{_gib(g.get('memory_total'))} GiB" if g else ""
            util = f"{g['utilization']:.0f}%" if g.get("utilization") is not None else "-"
            free = "free, warm" if gpu in warm else "free"
            who = f"{held['user']}" + (f" {held['name']!r}" if held and held.get("name") else "") if held else free
            lines.append(f"    GPU {gpu}: {util:>4} {used:<14} {who}")
    for i, ask in enumerate(report["queue"]):
        lines.append(f"queue {i + 1}: {ask['user']} wants {ask['gpus']} GPU(s), waiting {ask['waiting_s']:.0f} s")
    return "\n".join(lines)


def _gib(value: float | None) -> str:
    return "?" if value is None else f"{value / 2**30:.1f}"
