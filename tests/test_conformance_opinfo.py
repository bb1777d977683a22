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
    conformance.write_section("opinfo", conformance.document(results, seconds, "CPU"))
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


def test_a_gpu_servers_allowances_hide_no_wrong_result():
    """What the harness allows a GPU server (another generator, ties, CUDA's float32 statistics)
    takes only what cannot agree across devices: a wrong value stays wrong."""
    import types

    import torch

    # a random op that was wrong (its layouts, or a deterministic sample) is wrong, not excluded
    wrong = {"status": "wrong", "reason": "output: values differ"}
    assert conformance.outcome({"random": True, "forward": wrong}, "forward") == ("wrong", "output: values differ")
    assert conformance.outcome({"random": True, "forward": {"status": "match"}}, "forward")[0] == "excluded"
    assert conformance.outcome({"nondeterministic": True, "forward": wrong}, "forward")[0] == "excluded"
    # mode: another value that occurs as often (at a position holding it) is a tie; another is not
    mode = types.SimpleNamespace(name="mode")
    x = torch.tensor([[1, 1, 2, 2, 3], [4, 4, 4, 5, 5]])
    sample = types.SimpleNamespace(input=x, args=(1,), kwargs={})
    expected = (torch.tensor([1, 4]), torch.tensor([1, 2]))
    tied = (torch.tensor([2, 4]), torch.tensor([3, 2]))
    assert all(map(torch.equal, conformance._mode_ties(mode, sample, tied, expected), expected))
    for other in ((torch.tensor([3, 4]), torch.tensor([4, 2])), (torch.tensor([2, 4]), torch.tensor([4, 2]))):
        kept = conformance._mode_ties(mode, sample, other, expected)
        assert not torch.equal(kept[0], expected[0]), other  # less frequent, or not where it says
    # CUDA's float32 statistics of a half input: rounded to the CPU's dtype, and still compared
    norm = types.SimpleNamespace(name="native_layer_norm")
    want = (torch.ones(2, dtype=torch.float16), torch.tensor([0.5], dtype=torch.float16))
    got = conformance._cuda_statistics(norm, (want[0], torch.tensor([0.5])), want)
    assert got[1].dtype == torch.float16 and conformance._compare(got, want, "output")
    off = conformance._cuda_statistics(norm, (want[0], torch.tensor([0.75])), want)
    with pytest.raises(AssertionError):
        conformance._compare(off, want, "output")
    other = conformance._cuda_statistics(types.SimpleNamespace(name="add"), (want[0], torch.tensor([0.5])), want)
    with pytest.raises(AssertionError, match="float32 instead of"):  # only the ops CUDA does this for
        conformance._compare(other, want, "output")
