"""A TCP relay on 127.0.0.1 in front of a server's port, for tests that play the network: it can
look at or alter each chunk on the way (`on_chunk`), cut a connection after so many bytes from
the server (`cut_after`: the server "dies" in the middle of a handshake), or cut the link
altogether and heal it (`cut`, `heal`: the same port listens again). (tests/delay_relay.py is
the one relay that runs as a process of its own, inside a network namespace.)"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class Relay:
    def __init__(
        self,
        target_port: int,
        on_chunk: Callable[[bytes, str], bytes] | None = None,
        cut_after: int | None = None,
    ) -> None:
        self.target = target_port
        self.on_chunk = on_chunk  # (data, "up" to the server or "down" to the client) -> what passes
        self.cut_after = cut_after  # bytes from the server after which a connection is cut
        self.port = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self.heal()

    def heal(self) -> None:
        """Listen (again, on the same port)."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port = listener.getsockname()[1]
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Stop listening and close every connection through the relay."""
        self.close()
        with self._lock:
            sockets, self._open = self._open, []
        for s in sockets:
            _shut(s)
            s.close()

    def close(self) -> None:
        """Stop listening (connections through it go on)."""
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone would not)
        except OSError:
            pass
        self.listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                a, _ = listener.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._open += [a, b]
            threading.Thread(target=self._pump, args=(a, b, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        limit = self.cut_after if direction == "down" else None
        sent = 0
        try:
            while data := src.recv(1 << 16):
                if self.on_chunk is not None:
                    data = self.on_chunk(data, direction)
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: limit - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            _shut(s)
        if self.cut_after is not None:  # a cutting relay: both ends see the connection end here
            src.close()
            dst.close()


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
