"""Every benchmark runs in quick mode, so none of them rots. (Figures are not asserted here.)"""

import json

import pytest

from benchmarks.__main__ import ALL, main


@pytest.mark.timeout(300)  # nine benchmarks, a small LLM among them, on two shared cores
def test_benchmarks_run_in_quick_mode(tmp_path):
    names = [name for name in ALL if name != "soak"]  # tests/test_soak.py runs it for real
    assert main(["--quick", "--out", str(tmp_path), *names]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in results["benchmarks"]] == names
    assert (tmp_path / "results.md").read_text().startswith("# Benchmark results")
