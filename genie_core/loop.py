"""A tiny single-threaded loop over zmq sockets: the one place where sockets are touched.

Client, worker and server each own one `SocketLoop`. Other threads hand it work with
`call_soon` (thread-safe, wakes the loop at once through a pipe), so a zmq socket is only
ever used from the loop's thread, and it is closed there too: when the loop ends it runs its
`on_exit` callbacks, closes every socket it watched and ends its zmq context, in that order,
so ending a context can never wait on a socket another thread still holds.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from .threads import name_os_thread

log = logging.getLogger("genie")

Watched = TypeVar("Watched", "zmq.Socket[Any]", int)  # a zmq socket, or a file descriptor (a lifeline's pipe)


class SocketLoop:
    def __init__(self, name: str, context: zmq.Context[Any] | None = None) -> None:
        self.name = name
        self.context = context  # ended by the loop, after its sockets are closed
        self.on_exit: list[Callable[[], None]] = []
        self._outbox: dict[zmq.Socket[Any], deque[list[Any]]] = {}  # messages a socket could not take yet
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

    def add_socket(self, sock: Watched, on_readable: Callable[[Watched], None]) -> None:
        self.poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = on_readable

    def add_receiver(
        self, sock: zmq.Socket[Any], on_message: Callable[[list[zmq.Frame]], None], batch: int = 64
    ) -> None:
        """Watch `sock` and hand each message (its frames) to `on_message`, at most `batch` a turn:
        one busy socket cannot starve the others; what is left waits for the next turn."""

        def receive(sock: zmq.Socket[Any]) -> None:
            for _ in range(batch):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                on_message(frames)

        self.add_socket(sock, receive)

    def remove_socket(self, sock: zmq.Socket[Any] | int) -> None:
        self.poller.unregister(sock)
        self._handlers.pop(sock, None)
        if isinstance(sock, zmq.Socket):  # only sockets have an outbox
            self._outbox.pop(sock, None)

    def send(self, sock: zmq.Socket[Any], frames: list[Any]) -> None:
        """Send on the loop thread without ever blocking it: what the socket cannot take now (no
        peer yet, or a full queue) waits here and goes as soon as the socket is writable."""
        waiting = self._outbox.get(sock)
        if waiting is not None:
            waiting.append(frames)
            return
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._outbox[sock] = deque([frames])
            self.poller.modify(sock, zmq.POLLIN | zmq.POLLOUT)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        waiting = self._outbox.get(sock)
        while waiting:
            try:
                sock.send_multipart(waiting[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            waiting.popleft()
        self._outbox.pop(sock, None)
        self.poller.modify(sock, zmq.POLLIN)

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

    def stop(self, join: bool = True, timeout: float = 5.0) -> bool:
        """Stop (from any thread); with `join`, wait up to `timeout` s. True once it has ended."""
        if self._thread is None:  # never ran: nothing else can hold its sockets
            self._stopping = True
            self._finish()
            return True

        def _stop() -> None:
            self._stopping = True

        self.call_soon(_stop)
        if join and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error(
                    "genie %s loop did not stop within %g s; leaving it (its sockets stay open)", self.name, timeout
                )
                return False
        return self._closed

    def run(self) -> None:
        name_os_thread()
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
                    if exc.errno == errno.EINTR:
                        continue
                    raise
                for sock, flags in events:
                    if flags & zmq.POLLOUT:
                        self._guard(self._drain, sock)
                        if not flags & zmq.POLLIN:
                            continue
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
            self._finish()

    def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fn in self.on_exit:
            self._guard(fn)
        for sock in list(self._handlers):
            if isinstance(sock, zmq.Socket) and not sock.closed:
                sock.close(linger=0)
        self._handlers.clear()
        if self.context is not None:
            self.context.destroy(linger=0)  # any socket left (made here, never watched) goes too
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # one bad message or callback must never end the loop
            log.exception("genie %s loop: error in %r", self.name, fn)
