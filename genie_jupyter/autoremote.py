"""`%autoremote on|off` (ipyparallel's `%autopx`, for one server): while on, every cell is run as
a `%%remote` cell, by an input transformer that runs before IPython looks for magics. Cells that
manage Genie itself (`%autoremote`, `%genie_*`) and other cell magics (`%%...`) stay local."""

from __future__ import annotations

from typing import Any

LOCAL = ("%autoremote", "%genie_", "%%")  # a cell starting with one of these runs here


def _to_remote(lines: list[str]) -> list[str]:
    first = next((line.strip() for line in lines if line.strip()), "")
    if not first or first.startswith(LOCAL):
        return lines
    return ["%%remote\n", *lines]


def is_on(shell: Any) -> bool:
    return _to_remote in shell.input_transformers_cleanup


def turn_on(shell: Any) -> None:
    if not is_on(shell):
        shell.input_transformers_cleanup.append(_to_remote)


def turn_off(shell: Any) -> None:
    while _to_remote in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.remove(_to_remote)
