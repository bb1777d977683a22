"""`genie demo`: run a notebook through a real kernel and print each cell and its output."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def find_notebook(name: str | None) -> Path:
    if name and Path(name).exists():
        return Path(name)
    stem = name or "01_quickstart"
    filename = stem if stem.endswith(".ipynb") else f"{stem}.ipynb"
    here = Path(__file__).resolve().parent
    for candidate in (here / "notebooks" / filename, here.parent / "notebooks" / filename):
        if candidate.exists():
            return candidate
    raise SystemExit(f"genie demo: notebook {filename!r} not found")


def _output_text(output: dict) -> str:
    kind = output.get("output_type")
    if kind == "stream":
        return output.get("text", "")
    if kind in ("display_data", "execute_result"):
        data = output.get("data", {})
        if "text/plain" in data:
            return data["text/plain"] + "\n"
        return f"[{', '.join(sorted(data))}]\n"
    if kind == "error":
        return _ANSI.sub("", "\n".join(output.get("traceback", []))) + "\n"
    return ""


def run_demo(name: str | None = None, timeout: float = 300.0) -> int:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = find_notebook(name)
    nb = nbformat.read(path, as_version=4)
    print(f"genie demo: running {path} through a real kernel\n")
    counter = {"n": 0}

    def on_cell_executed(cell, cell_index, execute_reply) -> None:
        if cell.cell_type != "code":
            return
        counter["n"] += 1
        print(f"In [{counter['n']}]:")
        print("    " + cell.source.replace("\n", "\n    "))
        text = "".join(_output_text(o) for o in cell.get("outputs", []))
        if text.strip():
            print(f"Out[{counter['n']}]:")
            print("    " + text.rstrip().replace("\n", "\n    "))
        print(flush=True)

    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=timeout,
        on_cell_executed=on_cell_executed,
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()
    except CellExecutionError as exc:
        print(f"genie demo: a cell failed:\n{_ANSI.sub('', str(exc))}", file=sys.stderr)
        return 1
    print(f"genie demo: all {counter['n']} cells ran.")
    return 0


def command(sub: Any) -> Any:
    """The `genie demo` subcommand (registered through the `genie.commands` entry point group)."""
    demo = sub.add_parser("demo", help="start a local server and run the quickstart notebook, printing each cell")
    demo.add_argument("notebook", nargs="?", default=None, help="notebook to run (default: 01_quickstart)")
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per cell")
    return lambda args: run_demo(args.notebook, timeout=args.timeout)
