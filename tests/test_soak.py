"""Two minutes of four clients mixing everything against one server (benchmarks/soak.py): no
error but the interrupts asked for, and the server's memory (idle, before and after), descriptors,
threads and shared memory flat after the warm-up."""

import pytest
from reliability import record

from benchmarks import soak


@pytest.mark.timeout(600)
def test_a_two_minute_soak_stays_flat_and_error_free():
    result = soak.run(minutes=2)
    assert result["errors"] == 0, result["error_examples"]
    anon, left = result["server_anon_mib_first_third_last_third"], result["left_after_clients_went"]
    idle, rss = result["server_anon_mib_idle_before_after"], result["server_rss_mib_first_third_last_third"]
    figures = {k: v for k, v in result.items() if k.startswith(("server_", "left_", "pool_", "threads_"))}
    assert idle[1] - idle[0] < 10, figures
    assert all(v <= 0 for v in left.values()), (left, figures)
    assert result["shm_mib_left_after_clients_went"] <= 0, result
    assert all(n <= size for n, size in result["pool_threads_end_and_size"].values()), figures
    assert all(result["operations"].get(op, 0) > 0 for op in soak.OPS), result["operations"]
    record(
        "Soak (benchmarks/soak.py)",
        f"{result['seconds']} s, {result['clients']} clients (in CI)",
        f"{sum(result['operations'].values())} operations "
        f"({', '.join(f'{k} {v}' for k, v in sorted(result['operations'].items()))}), "
        f"0 errors; server's own memory idle {idle[0]} -> {idle[1]} MiB (under load {anon[0]} -> {anon[1]} MiB, RSS "
        f"{rss[0]} -> {rss[1]} MiB: medians of the first and last third after warm-up); once the clients "
        f"had gone, fds, threads and workers {left} against the warm-up baseline, /dev/shm left "
        f"{result['shm_mib_left_after_clients_went']} MiB",
    )


def test_a_segment_unlinked_while_it_is_counted_counts_nothing(monkeypatch, tmp_path):
    """A segment's owner may unlink it between the listing and the stat (CI saw it once)."""
    gone = tmp_path / "genie-w-7-gone"
    monkeypatch.setattr(soak.Path, "glob", lambda self, pattern: iter([gone]))
    monkeypatch.setattr(soak.Path, "is_file", lambda self: True)  # it was there a moment ago
    assert soak._shm_bytes({7}) == 0
