"""PyTorch's ModuleInfo database on `remote_accelerator` against eager CPU (see module_conformance.py).

Writes the table, and every module that does not match with its reason, to docs/CONFORMANCE.md
(see reliability.measured_doc); asserts no wrong result and no crash, at least 98% of modules
matching forward and backward, and that the suite really ran (few modules skipped).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal needs it

import module_conformance
import opinfo_conformance as conformance


def document(
    results: list[dict], seconds: float, server: str = "CPU with one thread, as the reference", workers: int = 2
) -> str:
    """The ModuleInfo part of docs/CONFORMANCE.md."""
    import platform

    import torch

    r = conformance.rates(results)
    lines = [
        "## PyTorch ModuleInfo database",
        "",
        f"Measured by `tests/test_conformance_modules.py` ({len(results)} entries of `module_db`, torch "
        f"{torch.__version__}, Python {platform.python_version()}, server device: {server}; "
        f"{seconds:.0f} s with {workers} client processes). For each module, in training and in eval "
        f"mode, its first {module_conformance.SAMPLES} float32 inputs (float64 where the CPU refuses every "
        "float32 one) with requires_grad=True: the module built on the CPU under a fixed seed, a deep copy "
        'moved with `.to("remote_accelerator")` (lazy modules before their first forward), the forward run '
        "on both under the same seed, then the gradients of the outputs with respect to the inputs and every "
        "parameter against CPU autograd. Modules that draw random numbers (dropout) are counted like the rest: "
        + (
            "on a CPU server, seeded alike, they must give the CPU's values."
            if server.startswith("CPU")
            else "on a GPU server, whose generator is another, their values cannot be the CPU's."
        ),
        "",
        "| | modules tested | match | bit-exact | wrong | raise | crash | rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("forward", "backward"):
        part = r[name]
        c = part["counts"]
        lines.append(
            f"| {name} | {part['tested']} | {c.get('match', 0)} | {part['exact']} | {c.get('wrong', 0)} | "
            f"{c.get('error', 0)} | {c.get('crash', 0)} | {100 * part['rate']:.1f}% |"
        )
    random = sorted(x["op"] for x in results if x.get("draws_random"))
    inexact = sorted(
        x["op"] for x in results if x.get("backward", {}).get("status") == "match" and not x["backward"]["exact"]
    )
    lines += [
        "",
        f"Draw random numbers (and match): {', '.join(random) if random else 'none'}. Gradients that match "
        f"within tolerance but not bit for bit: {', '.join(inexact) if inexact else 'none'}.",
        "",
    ]
    for mode in ("forward", "backward"):
        skipped = [x["op"] for x in results if conformance.outcome(x, mode)[0] == "skip"]
        lines.append(f"- skipped ({mode}): {', '.join(skipped) if skipped else 'none'}")
    failing = [
        (x["op"], mode, *conformance.outcome(x, mode))
        for x in results
        for mode in ("forward", "backward")
        if conformance.outcome(x, mode)[0] in ("wrong", "error", "crash")
    ]
    lines += ["", "Modules that raise (each with its reason) or give wrong results:", ""]
    lines += [f"- `{op}` ({mode}, {status}): {why}" for op, mode, status, why in failing] or ["- none"]
    lines.append("")
    return "\n".join(lines)


@pytest.mark.timeout(600)
def test_module_database_matches_the_cpu(tmp_path):
    from conftest import start_server

    # a CPU server (even on a GPU machine) with one thread, as the reference runs: reductions split
    # across threads round differently, and that is not the device's doing
    srv = start_server(tmp_path, "--gpus", "", env={"OMP_NUM_THREADS": "1"})
    try:
        start = time.perf_counter()
        results = conformance.run(f"127.0.0.1:{srv.info.port}", srv.info.token, workers=2, kind="modules")
        seconds = time.perf_counter() - start
    finally:
        srv.stop()
    conformance.write_section("modules", document(results, seconds))
    rates = conformance.rates(results)
    failing = {
        (r["op"], mode): conformance.outcome(r, mode)
        for r in results
        for mode in ("forward", "backward")
        if conformance.outcome(r, mode)[0] in ("wrong", "crash")
    }
    assert not failing, f"wrong results or crashes: {failing}"
    assert len(results) >= 110, "module_db shrank or the harness lost modules"
    assert rates["forward"]["rate"] >= 0.98, rates["forward"]
    assert rates["backward"]["rate"] >= 0.98, rates["backward"]
    skipped = rates["forward"]["counts"].get("skip", 0)
    assert skipped <= 0.03 * len(results), f"{skipped} modules skipped: the harness is not testing them"
