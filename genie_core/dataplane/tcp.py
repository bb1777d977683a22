"""`tcp`: bulk bytes on a plain TCP connection to the server's data port (the control port + 1),
beside the zmq control connection: `sendall` out, `recv_into` preallocated memory in. Payloads
carry a MAC off loopback (on loopback only this machine's users can see them)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from ..config import is_loopback
from ..errors import AuthenticationError, ConnectionFailed
from ..protocol.contents import DataRef
from ..threads import name_os_thread
from . import stream, wire
from .base import Backend, Candidate, Channel, Found, Link, ServerSide, measure_stream
from .segment import memory_spares, split

log = logging.getLogger("genie.data")


def drive(sock: socket.socket, exchange: stream.Exchange) -> Any:
    """Run one side of the exchange over a socket, synchronously; returns what it returns."""
    value: Any = None
    while True:
        try:
            step = exchange.send(value)
        except StopIteration as done:
            return done.value
        value = None
        if isinstance(step, stream.Send):
            sock.sendall(step.data)
        elif isinstance(step, stream.Receive):
            value = wire.recv_exact(sock, step.size)
        elif isinstance(step, stream.SendHeader):
            wire.send_header(sock, step.header)
        elif isinstance(step, stream.ReceiveHeader):
            value = wire.recv_header(sock, step.limit)
        elif isinstance(step, stream.SendPayload):
            _send_payload(sock, step)
        else:
            value = _receive_payload(sock, step)


def _send_payload(sock: socket.socket, step: stream.SendPayload) -> None:
    total = sum(memoryview(b).nbytes for b in step.buffers)
    try:
        for piece, end in stream.cut(step.buffers, wire.CHUNK):
            if step.filling is not None:
                step.filling.wait_for(end)
            if step.mac is not None:
                step.mac.update(piece)  # hashed while it is sent
            sock.sendall(piece)
            if step.progress is not None:
                step.progress(end, total)
    except BaseException:
        if step.mac is not None:
            step.mac.abandon()
        raise
    if step.mac is not None:
        sock.sendall(step.mac.digest())


def _receive_payload(sock: socket.socket, step: stream.ReceivePayload) -> bool:
    total = len(step.view)
    try:
        for piece, end in stream.cut(split(step.view, step.pieces or [total]), wire.CHUNK):
            wire.recv_exact_into(sock, piece)
            if step.mac is not None:
                step.mac.update(piece)  # hashed while the next piece arrives
            if step.progress is not None:
                step.progress(end, total)
    except BaseException:
        if step.mac is not None:
            step.mac.abandon()
        raise
    return stream.mac_matches(step.mac, wire.recv_exact(sock, 32) if step.mac is not None else b"")


class TcpChannel(Channel):
    name = "tcp"
    streams = True

    def __init__(self, host: str, port: int, key: bytes, session: str, timeout: float = 5.0) -> None:
        self.address = f"{host}:{port}"
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectionFailed(f"data port {self.address} unreachable: {exc.strerror or exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            want_mac = not is_loopback(self.sock.getpeername()[0])
            self.macs: wire.PayloadMacs = drive(self.sock, stream.authenticate(key, session, want_mac))
        except PermissionError:
            self.sock.close()
            raise AuthenticationError(f"the data port at {self.address} refused this session") from None
        except (ConnectionError, OSError, ValueError) as exc:
            self.sock.close()
            raise ConnectionFailed(f"{self.address} is not a genie data port: {exc}") from None
        self.mac_on = self.macs.on
        self.sock.settimeout(None)
        self.spares = memory_spares()

    def put(self, buffers: list[Any], progress: wire.Progress = None) -> DataRef:
        done: DataRef = drive(self.sock, stream.put(self.macs, buffers, progress))
        return done

    def get(self, ref: DataRef, progress: wire.Progress = None) -> list[Any]:
        total = sum(int(n) for n in ref["sizes"])
        into = self.spares.take(total, refill=False)  # bytes land here directly
        buffers: list[Any] = drive(self.sock, stream.get(self.macs, ref, into, progress))
        self.spares.refill(total)
        return buffers

    def ping(self) -> float:
        start = time.perf_counter()
        drive(self.sock, stream.ping())
        return time.perf_counter() - start

    def sink(self, payload: memoryview) -> float:
        start = time.perf_counter()
        drive(self.sock, stream.sink(self.macs, payload))
        return time.perf_counter() - start

    def close(self) -> None:
        self.spares.close()
        try:
            self.sock.close()
        except OSError:
            pass


class TcpListener:
    """The server's data port: a thread per connection, each driving `stream.serve`."""

    def __init__(self, ip: str, port: int, host: stream.DataHost) -> None:
        self.host = host
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((ip, port))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, name="genie-data-accept", daemon=True).start()

    def stop(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self.listener.close()

    def _accept(self) -> None:
        name_os_thread()
        while True:
            try:
                conn, addr = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, addr[0]), name="genie-data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        name_os_thread()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        exchange = stream.serve(self.host, mac_on=not is_loopback(peer))
        try:
            drive(conn, exchange)
        except (ConnectionError, OSError, ValueError, KeyError) as exc:
            log.debug("data connection from %s ended: %s", peer, exc)
        finally:
            exchange.close()  # its cleanup: segments filled and never adopted
            conn.close()


class Tcp(Backend):
    name = "tcp"

    def offer(self, side: ServerSide) -> dict[str, Any]:
        if side.encrypted:  # raw data ports carry no encryption
            return {"data_port": None}
        port = side.data_port if side.data_port is not None else (side.control_port + 1 if side.fixed_port else 0)
        try:
            self.listener = TcpListener(side.ip, port, side.host)
        except OSError as exc:
            log.warning("no tcp data plane: cannot listen on %s:%s (%s)", side.ip, port, exc.strerror)
            return {"data_port": None}
        return {"data_port": self.listener.port}

    def stop(self) -> None:
        if getattr(self, "listener", None) is not None:
            self.listener.stop()

    def probe(self, link: Link, budget: float, found: Found) -> tuple[Candidate, Channel | None]:
        port = link.data_port or link.server.get("data_port")
        if link.server.get("encrypted"):
            return Candidate(self.name, False, ENCRYPTED), None
        if not port:
            return Candidate(self.name, False, "the server has no data port"), None
        try:
            channel = TcpChannel(link.host, int(port), link.key, link.session, timeout=min(5.0, budget * 2))
            rtt, bandwidth = measure_stream(channel, budget)
        except (ConnectionFailed, AuthenticationError, OSError, ConnectionError) as exc:
            return Candidate(self.name, False, f"data port {link.host}:{port} not usable: {exc}"), None
        reason = f"data port {port}" + (", payload HMAC on" if channel.mac_on else " (loopback: no payload HMAC)")
        return Candidate(
            self.name, True, reason, rtt, bandwidth, {"port": int(port), "payload_mac": channel.mac_on}
        ), channel


ENCRYPTED = (
    "off: the server encrypts (--encrypt), and this backend would not; "
    "data goes over CURVE-encrypted zmq, or shm on one host"
)
