"""A child's life tied to its parent's through a pipe: when the parent ends, however it ends
(SIGKILL included), the kernel closes the pipe's write end and the child learns at once.

The server gives one to every worker (so no worker, and none of its children, outlives its
server and keeps holding GPU memory), and an embedded server gets one from its notebook kernel.
A process forked from the parent (user code's `os.fork`, multiprocessing's fork) does not keep
the write end: the child's life stays tied to the parent's alone.
"""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import weakref
from typing import Any

_held: weakref.WeakSet[Lifeline] = weakref.WeakSet()  # this process's write ends, for a forked child to drop


class Lifeline:
    """The parent's side: hand `fd` to a child (`pass_fds`), keep the write end while alive.

    One child per lifeline: SIGIO goes to one owner per pipe (the last to claim it with
    F_SETOWN), so children sharing a pipe would leave all but one to their slower checks.
    """

    def __init__(self) -> None:
        self.fd, self._write_end = os.pipe()  # both non-inheritable: only pass_fds hands `fd` on
        _held.add(self)

    def start(self, argv: list[str], pass_fds: tuple[int, ...] = (), **popen: Any) -> subprocess.Popen[Any]:
        """Start the child holding the read end (its number is `fd`, for its argv) beside
        `pass_fds`; ours goes once it holds it, and the whole lifeline if it could not start."""
        try:
            child = subprocess.Popen(argv, pass_fds=(self.fd, *pass_fds), **popen)
        except BaseException:
            self.close()
            raise
        self._close("fd")
        return child

    def close(self) -> None:
        """The child learns at once that we are gone."""
        self._close("fd")
        self._close("_write_end")

    def _close(self, name: str) -> None:
        fd = getattr(self, name)
        if fd >= 0:
            setattr(self, name, -1)  # never close a number the process has since reused
            os.close(fd)


def _forked() -> None:
    for lifeline in list(_held):
        lifeline.close()


os.register_at_fork(after_in_child=_forked)


def parent_gone(fd: int) -> bool:
    """True once the parent's end is closed (the pipe reads as end-of-file). An fd that is not
    open here says nothing (False)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    return any(events & (select.POLLIN | select.POLLHUP) for _, events in poller.poll(0))


def die_with_parent(fd: int) -> None:
    """End this process group the moment the parent does.

    The kernel sends SIGIO, whose default action ends a process, to the whole group when the
    pipe closes: no thread and no GIL are involved, so it works while user code holds the GIL
    in a long C call, and it takes the user's own child processes along (those that did not
    start a session of their own).
    """
    group = os.getpgrp()
    # A sandboxed worker's group lies outside its PID namespace (0 here): it takes the signal
    # alone, and its namespace (its cells' processes) ends with it.
    fcntl.fcntl(fd, fcntl.F_SETOWN, -group if group else os.getpid())
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC | os.O_NONBLOCK)
    if parent_gone(fd):  # it ended before we were listening
        os._exit(0)
