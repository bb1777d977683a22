"""Two minutes of four clients mixing everything against one server (benchmarks/soak.py): no
error but the interrupts asked for, and the server's memory, descriptors, threads and shared
memory flat after the warm-up."""

import pytest

from benchmarks import soak
from reliability import record


@pytest.mark.timeout(600)
def test_a_two_minute_soak_stays_flat_and_error_free():
    result = soak.run(minutes=2)
    assert result["errors"] == 0, result["error_examples"]
    growth = result["growth_after_warm_up"]
    assert growth["rss_mib"] < 10 and growth["fds"] <= 2 and growth["threads"] <= 1, result
    assert result["shm_mib_left_after_clients_left"] <= 0, result
    assert all(result["operations"].get(op, 0) > 0 for op in soak.OPS), result["operations"]
    record("Soak (benchmarks/soak.py)", f"{result['seconds']} s, {result['clients']} clients (in CI)",
           f"{sum(result['operations'].values())} operations ({', '.join(f'{k} {v}' for k, v in sorted(result['operations'].items()))}), "
           f"0 errors; server RSS {result['server_rss_mib_after_warm_up_first_third_last_third'][0]} -> "
           f"{result['server_rss_mib_after_warm_up_first_third_last_third'][1]} MiB after warm-up, fds {growth['fds']:+}, "
           f"threads {growth['threads']:+}, /dev/shm left {result['shm_mib_left_after_clients_left']} MiB")
