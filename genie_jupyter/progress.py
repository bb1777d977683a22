"""A progress bar for transfers that take more than a second: bytes, and the rate so far."""

from __future__ import annotations

import time
from typing import Any

from IPython.display import HTML, display

DELAY = 1.0  # seconds before a bar appears: short transfers show nothing
INTERVAL = 0.25  # at most four redraws a second


def _size(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


class TransferProgress:
    """Use as the `progress(done, total)` callback of `Client.push` / `Client.pull`."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.start = time.monotonic()
        self.handle: Any = None
        self.last = 0.0
        self.done = self.total = 0

    def _html(self, final: bool = False) -> HTML:
        took = max(time.monotonic() - self.start, 1e-9)
        rate = f"{_size(self.done / took)}/s"
        text = (
            f"{self.label}: {_size(self.done)} in {took:.1f} s ({rate})"
            if final
            else f"{self.label}: {_size(self.done)} of {_size(self.total)}, {rate}"
        )
        bar = (
            f'<progress value="{self.done}" max="{max(self.total, 1)}" '
            f'style="width: 20em" aria-label="{self.label}"></progress>'
        )
        return HTML(f"<div>{bar} <span>{text}</span></div>")

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = time.monotonic()
        if now - self.start < DELAY or now - self.last < INTERVAL:
            return
        self.last = now
        if self.handle is None:
            self.handle = display(self._html(), display_id=True)
        else:
            self.handle.update(self._html())

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.update(self._html(final=True))
