"""Hugging Face `transformers` models under `torch.compile` on `remote_accelerator`, against the same
models run eagerly on the CPU: the recipe people use for fast decoding (a static cache and the
model's forward compiled with `fullgraph=True`) and a compiled training step. The server of this
suite runs on its CPU and runs each captured graph as it is (`options={"compiler": "eager"}`), so
results must be equal bit for bit; Inductor on a GPU server is tests/test_gpu.py's."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("transformers")

from test_conformance_models import GENERATIVE, MODELS, _decoder, batch, on, twins, two_training_steps_match

from genie_core.remote_tensor import compiler

DEV = "remote_accelerator:0"
EAGER = {"backend": "remote_accelerator", "options": {"compiler": "eager"}}
RESULTS: dict[str, dict[str, str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _document(quiet_transformers):
    """docs/CONFORMANCE.md's compiled section, from what ran."""
    yield
    if not RESULTS:
        return
    import opinfo_conformance
    import transformers

    lines = [
        "## Hugging Face transformers models under torch.compile",
        "",
        f"Measured by `tests/test_conformance_compiled.py` (transformers {transformers.__version__}, "
        f"torch {torch.__version__}, a CPU server running each captured graph as it is). The same "
        "models as above. Training: the model compiled (`torch.compile(model)`), two steps of "
        "`loss.backward()` and AdamW, losses, gradients and parameters bit-equal to eager CPU. "
        'Generate: the static-cache recipe, `generate(cache_implementation="static")` with '
        "`model.forward = torch.compile(model.forward, fullgraph=True)`, 6 greedy tokens equal to "
        "eager CPU's; graphs are those Dynamo captured (prefill and decode).",
        "",
        "| model | compiled training steps | compiled static-cache generate | graphs | seconds |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind, _ in MODELS:
        row = RESULTS.get(kind, {})
        generate = row.get("generate", "n/a" if kind not in dict(DECODERS) else "not run")
        lines.append(
            f"| {kind} | {row.get('train', 'not run')} | {generate} | {row.get('graphs', '')} | "
            f"{row.get('seconds', '')} |"
        )
    opinfo_conformance.write_section("compiled", "\n".join(lines))


def _note(kind: str, what: str, outcome: str, seconds: float = 0.0, graphs: int = 0) -> None:
    row = RESULTS.setdefault(kind, {})
    row[what] = outcome
    row["seconds"] = f"{float(row.get('seconds') or 0) + seconds:.1f}"
    if graphs:
        row["graphs"] = str(int(row.get("graphs") or 0) + graphs)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kind, build", MODELS, ids=[k for k, _ in MODELS])
def test_a_compiled_training_step_equals_the_cpu(remote, kind, build):
    start, graphs = time.perf_counter(), compiler.stats["graphs"]
    _note(kind, "train", "FAILED")
    local, model = twins(build, kind)
    two_training_steps_match(local, model, torch.compile(model, **EAGER), batch(kind))
    assert compiler.stats["graphs"] > graphs  # compiled, not run eagerly
    _note(kind, "train", "equal", time.perf_counter() - start, compiler.stats["graphs"] - graphs)


DECODERS = [(k, b) for k, b in GENERATIVE if b is _decoder]


@pytest.mark.parametrize("kind, build", DECODERS, ids=[k for k, _ in DECODERS])
def test_static_cache_generate_with_a_compiled_forward_gives_the_cpus_tokens(remote, kind, build):
    start, graphs = time.perf_counter(), compiler.stats["graphs"]
    _note(kind, "generate", "FAILED")
    local, model = twins(build, kind)
    local.eval(), model.eval()
    inputs = {k: v for k, v in batch(kind).items() if k != "labels"}
    kwargs = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
    expected = local.generate(**inputs, **kwargs)
    model.forward = torch.compile(model.forward, fullgraph=True, **EAGER)
    for _ in range(2):  # the second generate reuses the compiled graphs
        got = model.generate(**on(inputs, DEV), **kwargs)
        assert torch.equal(got.cpu(), expected), f"{got.cpu().tolist()} != {expected.tolist()}"
    made = compiler.stats["graphs"] - graphs
    assert 1 <= made <= 2  # prefill and decode: no recompiles from one token to the next
    _note(kind, "generate", "equal tokens", time.perf_counter() - start, made)
