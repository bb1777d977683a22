"""A tiny single-threaded loop over zmq sockets: the one place where sockets are touched.

Client, worker and server each own one `SocketLoop`. Other threads hand it work with
`call_soon` (thread-safe, wakes the loop at once through a pipe), so a zmq socket is only
ever used from the loop's thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable

import zmq

log = logging.getLogger("genie")


class SocketLoop:
    def __init__(self, name: str) -> None:
        self.name = name
        self.poller = zmq.Poller()
        self._handlers: dict[Any, Callable[[Any], None]] = {}
        self._calls: deque[Callable[[], None]] = deque()
        self._timers: list[list[Any]] = []  # [next_due, interval, fn]
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def add_socket(self, sock: zmq.Socket, on_readable: Callable[[zmq.Socket], None]) -> None:
        self.poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = on_readable

    def remove_socket(self, sock: zmq.Socket) -> None:
        self.poller.unregister(sock)
        self._handlers.pop(sock, None)

    def call_every(self, interval: float, fn: Callable[[], None]) -> None:
        self._timers.append([time.monotonic() + interval, interval, fn])

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread; safe from any thread."""
        self._calls.append(fn)
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the loop will wake anyway) or closed

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"genie-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, join: bool = True, timeout: float = 5.0) -> None:
        def _stop() -> None:
            self._stopping = True

        self.call_soon(_stop)
        if join and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def run(self) -> None:
        if self._thread is None:
            self._thread = threading.current_thread()
        try:
            while not self._stopping:
                now = time.monotonic()
                due = min((t[0] for t in self._timers), default=now + 1.0)
                timeout_ms = max(0, int((due - now) * 1000) + 1)
                try:
                    events = self.poller.poll(timeout_ms)
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.EINTR:
                        continue
                    raise
                for sock, _ in events:
                    if sock == self._wake_r:
                        try:
                            while os.read(self._wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                        continue
                    handler = self._handlers.get(sock)
                    if handler is not None:
                        self._guard(handler, sock)
                while self._calls:
                    self._guard(self._calls.popleft())
                now = time.monotonic()
                for timer in self._timers:
                    if timer[0] <= now:
                        timer[0] = now + timer[1]
                        self._guard(timer[2])
        finally:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # one bad message or callback must never end the loop
            log.exception("genie %s loop: error in %r", self.name, fn)
