"""A TCP relay on 127.0.0.1 for tests that cut a link and heal it: everything passes until
`cut()`, which closes the listener and every connection through it; `heal()` listens again on
the same port."""

from __future__ import annotations

import socket
import threading


class Relay:
    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self.heal()

    def heal(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port = listener.getsockname()[1]
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            sockets, self._open = self._open, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                a, _ = listener.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._open += [a, b]
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
