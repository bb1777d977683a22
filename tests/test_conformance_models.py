"""Hugging Face `transformers` models on `remote_accelerator` against the same models on the CPU.

Each model is built from a small config with seeded random weights (nothing is downloaded), then
copied to the device. Forward outputs, a training step (loss.backward() and AdamW) and, for the
generative models, greedy and beam-search `generate()` with a DynamicCache and a StaticCache are
compared with the CPU; the server of this suite runs on its CPU, so results must be equal.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("quiet_transformers")

DEV = "remote_accelerator:0"
VOCAB = 96


def _tokens(**extra):
    return dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=1, **extra)


def _decoder(kind: str):
    t = transformers
    small = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **_tokens(),
    )
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, **_tokens()))
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**small))
    if kind == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**small))
    if kind == "mixtral":  # mixture of experts: top-2 of 4 experts per token
        return t.MixtralForCausalLM(t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **small))
    raise ValueError(kind)


def _other(kind: str):
    t = transformers
    if kind == "bert":
        return t.BertForMaskedLM(
            t.BertConfig(
                num_hidden_layers=2,
                hidden_size=64,
                intermediate_size=96,
                num_attention_heads=4,
                max_position_embeddings=64,
                vocab_size=VOCAB,
                pad_token_id=1,
            )
        )
    if kind == "t5":
        return t.T5ForConditionalGeneration(
            t.T5Config(
                num_layers=2,
                num_decoder_layers=2,
                d_model=64,
                d_ff=96,
                num_heads=4,
                d_kv=16,
                vocab_size=VOCAB,
                decoder_start_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
        )
    if kind == "vit":
        return t.ViTForImageClassification(
            t.ViTConfig(
                num_hidden_layers=2,
                hidden_size=64,
                intermediate_size=96,
                num_attention_heads=4,
                image_size=32,
                patch_size=8,
                num_labels=5,
            )
        )
    if kind == "resnet":
        return t.ResNetForImageClassification(
            t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5)
        )
    if kind == "convnext":  # channels-last convolutions, depthwise: laid out as the CPU lays them out
        return t.ConvNextForImageClassification(
            t.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)
        )
    raise ValueError(kind)


def twins(build, kind: str):
    """The same seeded model on the CPU and on the device."""
    torch.manual_seed(0)
    local = build(kind)
    return local, copy.deepcopy(local).to(DEV)


def batch(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    if kind in ("vit", "resnet", "convnext"):
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([3, 1])}
    ids = torch.randint(2, VOCAB, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    if kind == "t5":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(2, VOCAB, (2, 6), generator=g)}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def on(values: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in values.items()}


def assert_same(remote_value: torch.Tensor, local: torch.Tensor, what: str) -> None:
    got = remote_value.detach().cpu()
    assert got.dtype == local.dtype and got.shape == local.shape, what
    assert torch.equal(got, local.detach()), (
        f"{what}: max difference {(got.float() - local.float()).abs().max().item():.3g}"
    )


RESULTS: dict[str, dict[str, str]] = {}


@pytest.fixture(scope="module", autouse=True)
def _document():
    """docs/CONFORMANCE.md's models section, from what ran (a model that failed says so)."""
    yield
    if not RESULTS:
        return
    import platform

    import opinfo_conformance

    lines = [
        "## Hugging Face transformers models",
        "",
        f"Measured by `tests/test_conformance_models.py` (transformers {transformers.__version__}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, a CPU server). "
        "Small configs, seeded random weights, nothing downloaded. "
        '"equal" means bit for bit (`torch.equal`): logits in eval mode; '
        "two training steps (the same seeds for dropout, `loss.backward()`, AdamW): "
        "losses, every gradient, every parameter and buffer after them; generated tokens "
        "(6 new tokens, greedy and 3-beam search, each with a DynamicCache and a StaticCache).",
        "",
        "| model | forward and two AdamW steps | generate (greedy, beam) x (dynamic, static cache) | seconds |",
        "| --- | --- | --- | --- |",
    ]
    for kind, _ in MODELS:
        row = RESULTS.get(kind, {})
        generate = row.get("generate", "n/a" if kind not in dict(GENERATIVE) else "not run")
        lines.append(f"| {kind} | {row.get('train', 'not run')} | {generate} | {row.get('seconds', '')} |")
    opinfo_conformance.write_section("models", "\n".join(lines))


def _note(kind: str, what: str, outcome: str, seconds: float) -> None:
    row = RESULTS.setdefault(kind, {})
    row[what] = outcome
    row["seconds"] = f"{float(row.get('seconds') or 0) + seconds:.1f}"


MODELS = [
    ("gpt2", _decoder),
    ("llama", _decoder),
    ("qwen2", _decoder),
    ("mixtral", _decoder),
    ("bert", _other),
    ("t5", _other),
    ("vit", _other),
    ("resnet", _other),
    ("convnext", _other),
]


@pytest.mark.parametrize("kind, build", MODELS, ids=[k for k, _ in MODELS])
def test_forward_and_a_training_step_equal_the_cpu(remote, kind, build):
    start = time.perf_counter()
    _note(kind, "train", "FAILED", 0.0)  # until it gets to the end
    local, model = twins(build, kind)
    inputs = batch(kind)
    local.eval(), model.eval()
    with torch.no_grad():
        expected, got = local(**inputs), model(**on(inputs, DEV))
    assert_same(got.logits, expected.logits, "logits")

    two_training_steps_match(local, model, model, inputs)
    _note(kind, "train", "equal", time.perf_counter() - start)


def two_training_steps_match(local, model, run, inputs: dict[str, torch.Tensor]) -> None:
    """Two AdamW steps of `local` on the CPU and of `model` (called as `run`: itself, or compiled) on
    the device: losses, every gradient, every parameter and buffer after them, bit for bit."""
    local.train(), model.train()
    opt_local = torch.optim.AdamW(local.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        torch.manual_seed(10 + step)  # dropout draws from the CPU generator here, from the server's generator there
        loss_local = local(**inputs).loss
        torch.manual_seed(10 + step)
        loss = run(**on(inputs, DEV)).loss
        loss_local.backward(), loss.backward()
        assert_same(loss, loss_local, f"loss {step}")
        for (name, p), q in zip(local.named_parameters(), model.parameters(), strict=True):
            if p.grad is not None:
                assert_same(q.grad, p.grad, f"grad of {name}")
        opt_local.step(), opt.step()
        opt_local.zero_grad(), opt.zero_grad()
    for (name, p), q in zip(local.named_parameters(), model.parameters(), strict=True):
        assert_same(q, p, f"{name} after two AdamW steps")
    for (name, b), c in zip(local.named_buffers(), model.buffers(), strict=True):
        assert_same(c, b, f"buffer {name}")


GENERATIVE = [("gpt2", _decoder), ("llama", _decoder), ("qwen2", _decoder), ("mixtral", _decoder), ("t5", _other)]
DECODING = {"greedy": {"do_sample": False}, "beam": {"num_beams": 3, "do_sample": False}}
CACHES = {"dynamic": {}, "static": {"cache_implementation": "static"}}


@pytest.mark.parametrize("kind, build", GENERATIVE, ids=[k for k, _ in GENERATIVE])
def test_generate_gives_the_cpus_tokens(remote, kind, build):
    start = time.perf_counter()
    _note(kind, "generate", "FAILED", 0.0)
    local, model = twins(build, kind)
    local.eval(), model.eval()
    inputs = {k: v for k, v in batch(kind).items() if k != "labels"}
    for decoding, options in DECODING.items():
        for cache, cache_options in CACHES.items():
            kwargs = dict(max_new_tokens=6, min_new_tokens=6, **options, **cache_options)
            expected = local.generate(**inputs, **kwargs)
            got = model.generate(**on(inputs, DEV), **kwargs)
            assert got.device == torch.device(DEV)
            assert torch.equal(got.cpu(), expected), (
                f"{decoding} with a {cache} cache: {got.cpu().tolist()} != {expected.tolist()}"
            )
    _note(kind, "generate", "equal tokens (4 of 4)", time.perf_counter() - start)
