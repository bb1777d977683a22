"""Where a worker was when it crashed: on a fatal signal (a segfault in a CUDA library, a C
extension's abort) faulthandler writes every thread's Python stack into a file its server holds,
so the error the crash's request gets names the code it was in, instead of the stack going down
with the worker's stderr (a pipe its own thread reads)."""

from __future__ import annotations

import faulthandler
import os
import tempfile

ENV = "GENIE_CRASH_FD"  # the file's descriptor in the worker
LIMIT = 256 << 10  # what is read of it: a few threads' stacks are a few KiB


class CrashRecord:
    """The server's side: an unnamed file (nothing is left on disk) the worker inherits."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()  # noqa: SIM115 (open for the worker's life, closed by close)

    @property
    def fd(self) -> int:
        return self.file.fileno()

    def stack(self) -> list[str]:
        """What faulthandler wrote, line by line; [] when it wrote nothing (no fatal signal)."""
        try:
            self.file.seek(0)
            text = self.file.read(LIMIT).decode(errors="replace")
        except (OSError, ValueError):
            return []
        return [line for line in text.splitlines() if line.strip()]

    def close(self) -> None:
        self.file.close()


def innermost(stack: list[str]) -> str:
    """The crashing thread's last Python frame ('File "x.py", line 3 in f'), or ""."""
    current = next((i for i, line in enumerate(stack) if line.startswith("Current thread")), None)
    if current is None:
        return ""
    frame = next((line for line in stack[current + 1 :] if line.lstrip().startswith("File ")), "")
    return frame.strip()


def record_crashes() -> None:
    """The worker's side: every thread's stack into the server's file on SIGSEGV, SIGFPE, SIGABRT,
    SIGBUS or SIGILL (user code that calls faulthandler.enable itself takes it over)."""
    fd = os.environ.pop(ENV, "")
    if fd.isdigit():
        faulthandler.enable(file=int(fd), all_threads=True)
