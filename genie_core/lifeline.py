"""A child's life tied to its parent's through a pipe: when the parent ends, however it ends
(SIGKILL included), the kernel closes the pipe's write end and the child learns at once.

The server gives one to every worker (so no worker, and none of its children, outlives its
server and keeps holding GPU memory), and an embedded server gets one from its notebook kernel.
"""

from __future__ import annotations

import fcntl
import os
import select


class Lifeline:
    """The parent's side: hand `fd` to children (`pass_fds`), keep the write end while alive."""

    def __init__(self) -> None:
        self.fd, self._write_end = os.pipe()  # both non-inheritable: only pass_fds hands `fd` on

    def close(self) -> None:
        for fd in (self.fd, self._write_end):
            try:
                os.close(fd)
            except OSError:
                pass


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
    if os.getpgrp() == 0:  # a sandboxed worker: its group lies outside its PID namespace, and
        return  # bubblewrap ends it with the server (--die-with-parent); owning the shared pipe as 0 would
    fcntl.fcntl(fd, fcntl.F_SETOWN, -os.getpgrp())  # take SIGIO from every other worker
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC | os.O_NONBLOCK)
    if parent_gone(fd):  # it ended before we were listening
        os._exit(0)
