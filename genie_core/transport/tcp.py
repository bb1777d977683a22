"""`tcp`: bulk bytes on a plain TCP connection to the server's data port, `sendall` out and
`recv_into` preallocated memory in, beside (not inside) the zmq control connection."""

from __future__ import annotations

import socket
import time
from typing import Any

from ..config import is_loopback
from ..errors import AuthenticationError, ConnectionFailed
from . import wire
from .segment import memory_spares, split


class TcpTransport:
    name = "tcp"

    def __init__(self, host: str, port: int, key: bytes, session: str, timeout: float = 5.0) -> None:
        self.address = f"{host}:{port}"
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectionFailed(f"data port {self.address} unreachable: {exc.strerror or exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.key = key
        self.mac_on = not is_loopback(self.sock.getpeername()[0])
        greeting = wire.recv_exact(self.sock, len(wire.GREETING) + 32)
        if not greeting.startswith(wire.GREETING):
            raise ConnectionFailed(f"{self.address} is not a genie data port")
        nonce = greeting[len(wire.GREETING):]
        wire.send_header(self.sock, {"session": session, "proof": wire.handshake_mac(key, nonce, session).hex()})
        if not wire.recv_header(self.sock).get("ok"):
            raise AuthenticationError(f"the data port at {self.address} refused this session")
        self.macs = wire.PayloadMacs(key, nonce, self.mac_on)
        self.sock.settimeout(None)
        self.spares = memory_spares()

    def put(self, buffers: list[Any], progress: Any = None) -> dict[str, Any]:
        sizes = [memoryview(b).nbytes for b in buffers]
        wire.send_header(self.sock, {"op": "put", "sizes": sizes})
        wire.send_payload(self.sock, buffers, self.macs.start(b"up"), progress)
        reply = wire.recv_header(self.sock)
        if not reply.get("ok"):
            raise ConnectionError(f"data put failed: {reply.get('error')}")
        return {"segment": reply["segment"], "sizes": sizes, "via": "tcp"}

    def get(self, ref: dict[str, Any], progress: Any = None) -> list[Any]:
        sizes = [int(n) for n in ref["sizes"]]
        total = sum(sizes)
        wire.send_header(self.sock, {"op": "get", "segment": ref["segment"], "size": total})
        reply = wire.recv_header(self.sock)
        if not reply.get("ok"):
            raise ConnectionError(f"data get failed: {reply.get('error')}")
        whole = self.spares.take(total, refill=False)  # the destination: bytes land here directly
        wire.recv_payload_into(self.sock, whole[:total], self.macs.start(b"down"), progress)
        self.spares.refill(total)
        return split(whole, sizes)

    def ping(self) -> float:
        start = time.perf_counter()
        wire.send_header(self.sock, {"op": "ping"})
        wire.recv_header(self.sock)
        return time.perf_counter() - start

    def sink(self, nbytes: int) -> float:
        """Seconds to send `nbytes` that the server receives and discards (for discovery)."""
        payload = memoryview(bytearray(min(nbytes, wire.CHUNK)))
        start = time.perf_counter()
        wire.send_header(self.sock, {"op": "sink", "size": nbytes})
        left = nbytes
        while left:
            n = min(left, len(payload))
            self.sock.sendall(payload[:n])
            left -= n
        wire.recv_header(self.sock)
        return time.perf_counter() - start

    def close(self) -> None:
        self.spares.close()
        try:
            self.sock.close()
        except OSError:
            pass
