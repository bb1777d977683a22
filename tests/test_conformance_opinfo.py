"""PyTorch's OpInfo database on `remote_accelerator` against eager CPU (see opinfo_conformance.py).

Writes the measured rates, and every op that does not match with its reason, to
docs/CONFORMANCE.md (see reliability.measured_doc); asserts no wrong result and no crash, at least 98% of ops matching
forward and 95% backward, and that the suite really ran (few ops skipped).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal needs it

import opinfo_conformance as conformance
from reliability import measured_doc


@pytest.mark.timeout(900)
def test_opinfo_database_matches_the_cpu(tmp_path):
    from conftest import start_server

    srv = start_server(tmp_path, "--gpus", "")  # a CPU server, even on a GPU machine
    try:
        start = time.perf_counter()
        results = conformance.run(f"127.0.0.1:{srv.info.port}", srv.info.token, workers=2)
        seconds = time.perf_counter() - start
    finally:
        srv.stop()
    conformance.replace_section(measured_doc("CONFORMANCE.md"), "opinfo", conformance.document(results, seconds, "CPU"))
    rates = conformance.rates(results)
    failing = {
        (r["op"], mode): conformance.outcome(r, mode)
        for r in results
        for mode in ("forward", "backward")
        if conformance.outcome(r, mode)[0] in ("wrong", "crash")
    }
    assert not failing, f"wrong results or crashes: {failing}"
    assert len(results) >= 650, "op_db shrank or the harness lost ops"
    assert rates["forward"]["rate"] >= 0.98, rates["forward"]
    assert rates["backward"]["rate"] >= 0.95, rates["backward"]
    skipped = rates["forward"]["counts"].get("skip", 0)
    assert skipped <= 0.03 * len(results), f"{skipped} ops skipped: the harness is not testing them"
