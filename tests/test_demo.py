"""`genie demo`: a notebook run through a real kernel and printed for a terminal, prose included,
with what only a browser draws said in words and the kernel's own cell numbers."""

from __future__ import annotations

import subprocess
import sys

import nbformat


def test_demo_prints_prose_describes_rich_output_and_numbers_cells_as_the_kernel(tmp_path):
    cells = [
        nbformat.v4.new_markdown_cell("# A small demo\n\nThe last cell divides by zero on purpose."),
        nbformat.v4.new_code_cell(
            "from IPython.display import HTML, display\n"
            "display(HTML('<table><tr><th>x</th></tr><tr><td>1</td></tr><tr><td>2</td></tr><tr><td>3</td></tr></table>'))"
        ),
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3]);"),
        nbformat.v4.new_markdown_cell("Dividing by zero raises, and the traceback says where:"),
        nbformat.v4.new_code_cell("1 / 0", metadata={"tags": ["raises-exception"]}),
    ]
    path = tmp_path / "small.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    out = tmp_path / "figures"
    result = subprocess.run(
        [sys.executable, "-m", "genie_core", "demo", str(path), "--outputs", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    text = result.stdout
    assert result.returncode == 0, result.stderr
    assert "The last cell divides by zero on purpose." in text and "the traceback says where:" in text
    assert text.index("divides by zero on purpose") < text.index("In [1]:")  # the prose where it stands
    assert "[an HTML table, 3 rows]" in text and "IPython.core.display.HTML object" not in text
    png = (out / "cell2-1.png").read_bytes()
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert f"[a figure, {width}x{height}, saved to {out / 'cell2-1.png'}]" in text and width > 100
    assert "<Figure size" not in text
    assert "In [3]:" in text and "Cell In[3], line 1" in text  # the kernel's numbering, both places
