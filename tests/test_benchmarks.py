"""Every benchmark runs in quick mode, so none of them rots. (Figures are not asserted here.)"""

import json

import pytest

from benchmarks.__main__ import ALL, main


@pytest.mark.timeout(480)  # thirteen benchmarks one after another, a small LLM among them, on two shared cores
def test_benchmarks_run_in_quick_mode(tmp_path):
    names = [name for name in ALL if name != "soak"]  # tests/test_soak.py runs it for real
    # One lane: two at once would add two busy processes to the suite's own on two cores
    assert main(["--quick", "--jobs", "1", "--out", str(tmp_path), *names]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in results["benchmarks"]] == names
    assert (tmp_path / "results.md").read_text().startswith("# Benchmark results")


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_a_quick_run_deals_every_benchmark_once_into_lanes(jobs):
    """Lanes run at once, each in its own process: every benchmark in exactly one, in run order;
    those sharing the ipyparallel cluster (started once per process) in the same one."""
    from benchmarks.__main__ import IPYPARALLEL_USERS, lanes

    dealt = lanes(ALL, jobs)
    assert len(dealt) == jobs and sorted(n for lane in dealt for n in lane) == sorted(ALL)
    assert all(lane == sorted(lane, key=ALL.index) for lane in dealt)
    assert sum(set(lane) >= IPYPARALLEL_USERS for lane in dealt) == 1
    assert lanes(["soak"], jobs) == [["soak"]]


def test_across_hosts_says_it_was_skipped_where_there_is_no_ip_command(monkeypatch, tmp_path):
    """A machine without iproute2 (a lent GPU machine's image) gets the benchmark's "skipped" line,
    not a FileNotFoundError from the first `ip` call."""
    import os

    from benchmarks import across_hosts

    monkeypatch.setattr(os, "geteuid", lambda: 0)  # (as root, which is what the check is for)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    result = across_hosts.run(quick=True)
    assert "needs root and `ip netns`" in result["skipped"]
