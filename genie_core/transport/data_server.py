"""The server's side of the `tcp` data plane: a plain TCP listener beside the zmq port.

Each connection proves it holds the token (challenge-response) and names its session; then it
puts bytes into a shared-memory segment the session's worker reads, or gets bytes a worker
staged in one. Payloads on non-loopback links carry an HMAC trailer.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Callable

from ..config import is_loopback
from . import wire
from .segment import Segment, segment_spares

log = logging.getLogger("genie.data")


class DataServer:
    def __init__(self, ip: str, port: int, key: bytes, session_workers: Callable[[str], list[int] | None],
                 owners: dict[str, str] | None = None, max_put: int = 1 << 50) -> None:
        """`session_workers(session_id)` -> the pids of that session's workers, or None if unknown;
        `owners` maps the segments filled here to their session (shared with the ucx listener);
        a put over `max_put` bytes ends the connection before any memory is taken for it."""
        self.key = key
        self.max_put = max_put
        self.session_workers = session_workers
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((ip, port))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.segments: dict[str, str] = {} if owners is None else owners  # segment name -> session that owns it
        self._stop = False
        self._scratch = bytearray(wire.CHUNK)

    def start(self) -> "DataServer":
        threading.Thread(target=self._accept, name="genie-data-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop = True
        try:
            self.listener.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, addr = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, addr), name="genie-data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        made: list[Segment] = []  # segments this connection filled; the worker adopts them
        spares = segment_spares("genie-s")
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = addr[0]
        mac_on = not is_loopback(peer)
        try:
            session, nonce = self._authenticate(conn)
            if session is None:
                return
            macs = wire.PayloadMacs(self.key, nonce, mac_on)
            while True:
                header = wire.recv_header(conn)
                op = header.get("op")
                if op == "ping":
                    wire.send_header(conn, {"ok": True})
                elif op == "put":
                    sizes = [int(n) for n in header["sizes"]]
                    wire.check_put(sizes, self.max_put)
                    self._forget_adopted(made)
                    segment = spares.take(sum(sizes), refill=False)
                    made.append(segment)
                    try:
                        wire.recv_payload_into(conn, segment.view[: sum(sizes)], macs.start(b"up"))
                    finally:
                        segment.close()
                    self.segments[segment.name] = session
                    wire.send_header(conn, {"ok": True, "segment": segment.name, "sizes": sizes})
                    spares.refill(sum(sizes))
                elif op == "get":
                    self._send_staged(conn, session, header, macs)
                elif op == "sink":  # discovery: how fast can we receive
                    left = int(header["size"])
                    scratch = memoryview(self._scratch)
                    while left:
                        n = min(left, len(scratch))
                        wire.recv_exact_into(conn, scratch[:n])
                        left -= n
                    wire.send_header(conn, {"ok": True})
                else:
                    wire.send_header(conn, {"ok": False, "error": f"unknown op {op!r}"})
        except (ConnectionError, OSError, ValueError, KeyError) as exc:
            log.debug("data connection from %s ended: %s", peer, exc)
        finally:
            spares.close()
            for segment in made:  # filled but never adopted (the client went away): free them
                self.segments.pop(segment.name, None)
                segment.unlink()
            conn.close()

    def _forget_adopted(self, made: list[Segment]) -> None:
        for segment in list(made):
            if not segment.path.exists():
                made.remove(segment)
                self.segments.pop(segment.name, None)

    def _authenticate(self, conn: socket.socket) -> tuple[str | None, bytes]:
        nonce = os.urandom(32)
        conn.sendall(wire.GREETING + nonce)
        header = wire.recv_header(conn, limit=4096)
        session = str(header.get("session", ""))
        proof = bytes.fromhex(str(header.get("proof", "")))
        import hmac

        if self.session_workers(session) is None or not hmac.compare_digest(proof, wire.handshake_mac(self.key, nonce, session)):
            wire.send_header(conn, {"ok": False, "error": "authentication failed"})
            log.warning("refused a data connection: bad proof or unknown session")
            return None, nonce
        wire.send_header(conn, {"ok": True})
        return session, nonce

    def _send_staged(self, conn: socket.socket, session: str, header: dict[str, Any], macs: wire.PayloadMacs) -> None:
        """Send a segment a worker of this session staged for a pull (and nobody else's)."""
        name = str(header["segment"])
        pids = self.session_workers(session) or []
        parts = name.split("-")
        if len(parts) < 4 or parts[1] != "w" or not parts[2].isdigit() or int(parts[2]) not in pids:
            wire.send_header(conn, {"ok": False, "error": "no such staged data for this session"})
            return
        try:
            view = Segment.adopt(name)  # staged for exactly one pull: gone once sent
        except (OSError, ValueError):
            wire.send_header(conn, {"ok": False, "error": "no such staged data for this session"})
            return
        size = int(header["size"])
        wire.send_header(conn, {"ok": True, "size": size})
        wire.send_payload(conn, [view[:size]], macs.start(b"down"))
