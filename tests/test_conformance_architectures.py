"""More `transformers` architectures on `remote_accelerator` against the CPU: the eval forward and
every gradient of a backward, bit for bit, and greedy `generate()` for the generative ones.

test_conformance_models.py trains and decodes nine models in depth; this suite is its breadth: each
architecture brings ops and layouts of its own (ALiBi, relative positions, rotary variants, mixtures
of experts, state-space scans, depthwise and channels-last convolutions, windowed attention, audio
front ends), built from a tiny config with seeded random weights, nothing downloaded. The server of
this suite runs on its CPU, so results must be equal, dropout's included (seeded alike: the CPU's
generator here, the server device's there). Not what a model draws from the CPU's generator beside
the device's (wav2vec2's layer drop, `torch.rand([])`) or from numpy (its time masks): those draw
differently on any device, CUDA's too, and are off.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("quiet_transformers")

DEV = "remote_accelerator:0"
V = 96
_SMALL = {
    "vocab_size": V,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


def _decoder(model: str, config: str, **extra: Any) -> Callable[[], Any]:
    return lambda: getattr(transformers, model)(getattr(transformers, config)(**{**_SMALL, **extra}))


def _built(model: str, config: str, **settings: Any) -> Callable[[], Any]:
    return lambda: getattr(transformers, model)(getattr(transformers, config)(**settings))


_SEQ2SEQ = {
    "vocab_size": V,
    "d_model": 32,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 64,
}
_VISION = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}

# name -> (builder, inputs kind, generative)
ARCHITECTURES: dict[str, tuple[Callable[[], Any], str, bool]] = {
    "mistral": (_decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=2), "text", True),
    "gemma": (_decoder("GemmaForCausalLM", "GemmaConfig", head_dim=8, num_key_value_heads=2), "text", True),
    "gemma2": (_decoder("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, num_key_value_heads=2), "text", True),
    "phi": (_decoder("PhiForCausalLM", "PhiConfig"), "text", True),
    "phi3": (_decoder("Phi3ForCausalLM", "Phi3Config", pad_token_id=0), "text", True),
    "falcon": (_decoder("FalconForCausalLM", "FalconConfig"), "text", True),
    "gpt_neox": (_decoder("GPTNeoXForCausalLM", "GPTNeoXConfig"), "text", True),
    "stablelm": (_decoder("StableLmForCausalLM", "StableLmConfig", num_key_value_heads=4), "text", True),
    "olmo": (_decoder("OlmoForCausalLM", "OlmoConfig"), "text", True),
    "qwen3": (_decoder("Qwen3ForCausalLM", "Qwen3Config", head_dim=8, num_key_value_heads=2), "text", True),
    "qwen2_moe": (
        _decoder(
            "Qwen2MoeForCausalLM",
            "Qwen2MoeConfig",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_key_value_heads=4,
        ),
        "text",
        True,
    ),
    "gptj": (
        _built("GPTJForCausalLM", "GPTJConfig", vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
        "text",
        True,
    ),
    "bloom": (
        _built("BloomForCausalLM", "BloomConfig", vocab_size=V, hidden_size=32, n_layer=2, n_head=4),
        "text",
        True,
    ),
    "opt": (
        _built(
            "OPTForCausalLM",
            "OPTConfig",
            **{**_SMALL, "ffn_dim": 64, "word_embed_proj_dim": 32},
        ),
        "text",
        True,
    ),
    "mamba": (
        _built("MambaForCausalLM", "MambaConfig", vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8),
        "tokens",
        True,
    ),
    "rwkv": (
        _built(
            "RwkvForCausalLM",
            "RwkvConfig",
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            attention_hidden_size=32,
            intermediate_size=64,
            context_length=64,
        ),
        "tokens",
        True,
    ),
    "bart": (_built("BartForConditionalGeneration", "BartConfig", **_SEQ2SEQ), "seq2seq", True),
    "whisper": (
        _built(
            "WhisperForConditionalGeneration",
            "WhisperConfig",
            **{**_SEQ2SEQ, "num_mel_bins": 16, "max_source_positions": 16, "max_target_positions": 32},
            pad_token_id=0,
            decoder_start_token_id=1,
        ),
        "audio",
        True,
    ),
    "roberta": (_built("RobertaForMaskedLM", "RobertaConfig", **_SMALL, pad_token_id=1), "text", False),
    "deberta_v2": (
        _built(
            "DebertaV2ForMaskedLM",
            "DebertaV2Config",
            **_SMALL,
            relative_attention=True,
            position_buckets=16,
            pos_att_type=["p2c", "c2p"],
        ),
        "text",
        False,
    ),
    "albert": (_built("AlbertForMaskedLM", "AlbertConfig", **_SMALL, embedding_size=16), "text", False),
    "modernbert": (
        _built(
            "ModernBertForMaskedLM",
            "ModernBertConfig",
            **_SMALL,
            pad_token_id=0,
            global_attn_every_n_layers=2,
            local_attention=8,
        ),
        "text",
        False,
    ),
    "swin": (
        _built(
            "SwinForImageClassification",
            "SwinConfig",
            image_size=32,
            patch_size=4,
            embed_dim=8,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
            num_labels=5,
        ),
        "image",
        False,
    ),
    "mobilenet_v2": (
        _built(
            "MobileNetV2ForImageClassification", "MobileNetV2Config", image_size=32, depth_multiplier=0.25, num_labels=5
        ),
        "image",
        False,
    ),
    "wav2vec2": (
        _built(
            "Wav2Vec2ForCTC",
            "Wav2Vec2Config",
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            conv_dim=(8, 8),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=4,
            layerdrop=0.0,  # (drawn with torch.rand([]) on the CPU: see the module's docstring)
            mask_time_prob=0.0,  # (drawn with numpy)
        ),
        "waveform",
        False,
    ),
    "clip": (
        _built(
            "CLIPModel",
            "CLIPConfig",
            text_config=dict(_SMALL, num_hidden_layers=1, max_position_embeddings=16),
            vision_config=dict(_VISION, intermediate_size=64),
            projection_dim=16,
        ),
        "text and image",
        False,
    ),
}


def _inputs(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, V, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    return {
        "text": {"input_ids": ids, "attention_mask": mask},
        "tokens": {"input_ids": ids},
        "seq2seq": {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :6]},
        "audio": {"input_features": torch.randn(2, 16, 32, generator=g), "decoder_input_ids": ids[:, :5]},
        "image": {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)},
        "waveform": {"input_values": torch.randn(2, 400, generator=g)},
        "text and image": {"input_ids": ids, "pixel_values": torch.randn(2, 3, 32, 32, generator=g)},
    }[kind]


def _first(out: Any) -> torch.Tensor:
    for name in ("logits", "logits_per_image"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return out[0]


RESULTS: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _document():
    """docs/CONFORMANCE.md's architectures section, from what ran."""
    yield
    if not RESULTS:
        return
    import opinfo_conformance

    lines = [
        "## More transformers architectures",
        "",
        f"Measured by `tests/test_conformance_architectures.py` (transformers {transformers.__version__}, "
        f"torch {torch.__version__}, a CPU server): tiny configs, seeded weights; the eval forward and every "
        "gradient of a backward (dropout seeded alike), bit for bit; greedy `generate()` (5 new tokens, dynamic cache) "
        "for the generative ones.",
        "",
        "| architecture | result |",
        "| --- | --- |",
    ]
    lines += [f"| {name} | {RESULTS.get(name, 'not run')} |" for name in ARCHITECTURES]
    opinfo_conformance.write_section("architectures", "\n".join(lines))


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_an_architecture_computes_as_on_the_cpu(remote, name):
    build, kind, generative = ARCHITECTURES[name]
    start = time.perf_counter()
    RESULTS[name] = "FAILED"
    torch.manual_seed(0)
    local = build()
    model = copy.deepcopy(local).to(DEV)
    inputs = _inputs(kind)
    on_device = {k: v.to(DEV) for k, v in inputs.items()}
    local.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(_first(model(**on_device)).cpu(), _first(local(**inputs))), "eval forward"
    local.train(), model.train()
    torch.manual_seed(1)  # dropout: the CPU's generator here, the server device's there, seeded alike
    _first(local(**inputs)).float().square().mean().backward()
    torch.manual_seed(1)
    _first(model(**on_device)).float().square().mean().backward()
    for (where, p), q in zip(local.named_parameters(), model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), where
        assert p.grad is None or torch.equal(q.grad.cpu(), p.grad), f"gradient of {where}"
    outcome = "equal (forward, gradients)"
    if generative:
        local.eval(), model.eval()
        prompt = {k: v[:1] for k, v in inputs.items() if k != "decoder_input_ids" and k != "attention_mask"}
        settings = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False}
        expected = local.generate(**prompt, **settings)
        got = model.generate(**{k: v.to(DEV) for k, v in prompt.items()}, **settings)
        assert torch.equal(got.cpu(), expected), "greedy tokens"
        outcome = "equal (forward, gradients, greedy tokens)"
    RESULTS[name] = f"{outcome}, {time.perf_counter() - start:.1f} s"
