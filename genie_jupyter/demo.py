"""`genie demo`: run a notebook through a real kernel and print each cell and its output."""

from __future__ import annotations

import base64
import re
import sys
import tempfile
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


_DEFAULT_REPR = re.compile(r"^<(.+ object( at 0x[0-9a-f]+)?|Figure size .*)>$")


def _png_size(png: bytes) -> tuple[int, int]:
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


class _Outputs:
    """Each output as text a terminal can show: streams and text as they are, and for what only a
    browser draws, what it is (an HTML table and its rows; a figure, its size and where its image
    was saved)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.saved = 0

    def text(self, output: dict[str, Any], cell: int) -> str:
        kind = output.get("output_type")
        if kind == "stream":
            return str(output.get("text", ""))
        if kind == "error":
            return _ANSI.sub("", "\n".join(output.get("traceback", []))) + "\n"
        if kind not in ("display_data", "execute_result"):
            return ""
        data = output.get("data", {})
        plain = data.get("text/plain", "")
        if "image/png" in data:
            png = base64.b64decode(data["image/png"])
            self.saved += 1
            self.folder.mkdir(parents=True, exist_ok=True)
            path = (self.folder / f"cell{cell}-{self.saved}.png").resolve()
            path.write_bytes(png)
            width, height = _png_size(png)
            return f"[a figure, {width}x{height}, saved to {path}]\n"
        if plain and not _DEFAULT_REPR.match(plain.strip()):
            return f"{plain}\n"
        if "text/html" in data:
            html = data["text/html"]
            rows = re.findall(r"<tr[^>]*>(.*?)</tr>", html, re.IGNORECASE | re.DOTALL)
            if rows:
                data_rows = sum(1 for row in rows if re.search(r"<td", row, re.IGNORECASE))  # not the header's
                return f"[an HTML table, {data_rows} row{'s' if data_rows != 1 else ''}]\n"
            return f"[HTML, {len(html):,} characters: open the notebook in Jupyter to see it]\n"
        if "text/markdown" in data:
            return f"{data['text/markdown']}\n"
        return f"[{', '.join(sorted(data))}]\n"


def _indented(text: str) -> str:
    return "    " + text.rstrip().replace("\n", "\n    ")


def run_demo(name: str | None = None, timeout: float = 300.0, outputs: Path | None = None) -> int:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = find_notebook(name)
    nb = nbformat.read(path, as_version=4)
    print(f"genie demo: running {path} through a real kernel\n")
    shown = _Outputs(outputs or Path(tempfile.mkdtemp(prefix="genie-demo-")))
    ran = {"code": 0}

    def on_cell_executed(cell: Any, cell_index: int, execute_reply: dict[str, Any]) -> None:
        if cell.cell_type != "code":
            return
        ran["code"] += 1
        n = execute_reply.get("content", {}).get("execution_count") or cell.get("execution_count") or ran["code"]
        print(f"In [{n}]:")  # the kernel's count, as the traceback's "Cell In[n]" says
        print(_indented(cell.source))
        text = "".join(shown.text(o, n) for o in cell.get("outputs", []))
        if text.strip():
            print(f"Out[{n}]:")
            print(_indented(text))
        print(flush=True)

    def on_cell_start(cell: Any, cell_index: int) -> None:
        for markdown in _markdown_before(nb, cell_index):
            print(markdown.rstrip() + "\n", flush=True)

    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=timeout,
        on_cell_executed=on_cell_executed,
        on_cell_start=on_cell_start,
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()
    except CellExecutionError as exc:
        print(f"genie demo: a cell failed:\n{_ANSI.sub('', str(exc))}", file=sys.stderr)
        return 1
    for markdown in _markdown_before(nb, len(nb.cells)):
        print(markdown.rstrip() + "\n")
    print(f"genie demo: all {ran['code']} code cells ran." + (f" Figures: {shown.folder}" if shown.saved else ""))
    return 0


def _markdown_before(nb: Any, index: int) -> list[str]:
    """The Markdown cells just before cell `index` (since the previous code cell): the notebook's
    prose, printed where it stands."""
    found: list[str] = []
    i = index - 1
    while i >= 0 and nb.cells[i].cell_type != "code":
        if nb.cells[i].cell_type == "markdown":
            found.insert(0, nb.cells[i].source)
        i -= 1
    return found


def command(sub: Any) -> Any:
    """The `genie demo` subcommand (registered through the `genie.commands` entry point group)."""
    demo = sub.add_parser("demo", help="start a local server and run the quickstart notebook, printing each cell")
    demo.add_argument("notebook", nargs="?", default=None, help="notebook to run (default: 01_quickstart)")
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per cell")
    demo.add_argument(
        "--outputs", type=Path, default=None, help="folder for the figures (default: a new temporary one)"
    )
    return lambda args: run_demo(args.notebook, timeout=args.timeout, outputs=args.outputs)
