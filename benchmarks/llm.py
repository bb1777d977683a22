"""LLM decode and training on `remote_accelerator`, against the same code run on the server
directly (the on-device anchor: what a `%%remote` cell costs, timed inside the worker).

A GPT-2-small-sized model (12 layers, 768 wide, 50,257-token vocabulary, random weights, made on
the device from a seed): `generate(max_new_tokens=64)` (greedy, the default dynamic cache) and an
AdamW training step on 2 x 64 tokens. Remote and anchor rounds alternate; medians are reported,
with round trips (waits for the server) and messages per token and per step, and where the time
goes: the worker's time running what was sent, and the client's own time (recording the ops).
Targets (issue 12): 1 round trip per token and at most 2 ms/token over the anchor; a training
step at most 1.2x the anchor, in 1 round trip.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

import genie_core

from . import _servers

DEV = "remote_accelerator:0"

_BUILD = """
import json, time, torch, transformers
transformers.logging.set_verbosity_error()
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
_cfg = GPT2Config(**{config})
_dev = "cuda" if torch.cuda.is_available() else "cpu"
with torch.device(_dev):
    anchor_model = GPT2LMHeadModel(_cfg).eval()
anchor_opt = torch.optim.AdamW(anchor_model.parameters(), lr=1e-4)
"""

_GENERATE = """
_ids = torch.tensor({ids}, device=_dev)
anchor_model.eval()
_sync = torch.cuda.synchronize if _dev == "cuda" else (lambda: None)
_t = time.perf_counter()
_out = anchor_model.generate(_ids, max_new_tokens={n}, min_new_tokens={n}, do_sample=False)
_sync()
print(json.dumps({{"s": time.perf_counter() - _t, "tokens": _out[0].tolist()}}))
"""

_STEP = """
_ids = torch.tensor({ids}, device=_dev)
anchor_model.train()
_t = time.perf_counter()
_loss = anchor_model(input_ids=_ids, labels=_ids).loss
_loss.backward()
anchor_opt.step()
anchor_opt.zero_grad()
_value = _loss.item()
print(json.dumps({{"s": time.perf_counter() - _t, "loss": _value}}))
"""


def _on_server(client, code: str) -> dict:
    out = ""
    for msg in client.execute(code).replies(600):
        if msg.type == "stream" and msg.content.get("name") == "stdout":
            out += msg.content["text"]
        if msg.type == "execute_reply" and msg.content.get("status") != "ok":
            raise RuntimeError(f"anchor failed on the server: {msg.content.get('ename')}: {msg.content.get('evalue')}")
    return json.loads(out.strip().splitlines()[-1])


def _counters() -> dict:
    return dict(torch.remote_accelerator.stats()["0"])


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ("round_trips", "messages", "ops_sent", "server_seconds", "wait_seconds")}


def _top(profile: dict, per: int, n: int = 6) -> str:
    """The worker's most expensive ops (milliseconds per token or step), and the rest."""
    ranked = sorted(profile.items(), key=lambda kv: -kv[1][0])
    parts = [
        f"{name.removeprefix('aten.').removesuffix('.default')} {1000 * sec / per:.1f} ({calls // per or calls}x)"
        for name, (sec, calls) in ranked[:n]
    ]
    rest = sum(sec for _, (sec, _) in ranked[n:])
    return "; ".join(parts) + f"; other {1000 * rest / per:.1f}"


def run(quick: bool = False) -> dict:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    from genie_core.remote_tensor.device import stream_for

    transformers.logging.set_verbosity_error()
    config = (
        {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1000, "n_positions": 256}
        if quick
        else {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    )
    new_tokens, rounds = (8, 1) if quick else (64, 5)
    proc, info = _servers.start()
    genie_core.init_sync(f"{info.ip}:{info.port}", token=info.token, timeout=30)
    client = genie_core.get_cluster_state().client
    try:
        _on_server(client, _BUILD.format(config=repr(config)) + "print(json.dumps({}))")
        torch.manual_seed(0)
        with torch.device(DEV):
            model = GPT2LMHeadModel(GPT2Config(**config)).eval()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, config["vocab_size"], (1, 16), generator=g)
        batch = torch.randint(0, config["vocab_size"], (2, 64), generator=g)

        def generate() -> tuple[float, dict, list]:
            before = _counters()
            start = time.perf_counter()
            out = model.generate(prompt.to(DEV), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            tokens = out[0].tolist()  # the one wait at the end
            return time.perf_counter() - start, _delta(before, _counters()), tokens

        def step() -> tuple[float, dict]:
            model.train()
            before = _counters()
            start = time.perf_counter()
            loss = model(input_ids=batch.to(DEV), labels=batch.to(DEV)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            seconds = time.perf_counter() - start
            model.eval()
            return seconds, _delta(before, _counters())

        stream = stream_for(0)
        default_pipelined = stream.pipelined
        generate()  # warm: meta-shape caches, the worker, the allocator
        _on_server(client, _GENERATE.format(ids=prompt.tolist(), n=new_tokens))
        remote, anchor, other, counts, same_tokens = [], [], [], [], True
        for _ in range(rounds):
            stream.pipelined = default_pipelined
            seconds, delta, tokens = generate()
            remote.append(seconds)
            counts.append(delta)
            stream.pipelined = not default_pipelined  # the other way, for comparison
            other.append(generate()[0])
            stream.pipelined = default_pipelined
            on_device = _on_server(client, _GENERATE.format(ids=prompt.tolist(), n=new_tokens))
            anchor.append(on_device["s"])
            same_tokens &= on_device["tokens"] == tokens

        stream.profile = {}  # one more generate, with the worker timing each op
        generate()
        decode_profile, stream.profile = stream.profile, None

        step()
        _on_server(client, _STEP.format(ids=batch.tolist()))
        step_remote, step_anchor, step_counts = [], [], []
        for _ in range(max(1, rounds - 2)):
            seconds, delta = step()
            step_remote.append(seconds)
            step_counts.append(delta)
            step_anchor.append(_on_server(client, _STEP.format(ids=batch.tolist()))["s"])
        stream.profile = {}
        step()
        step_profile, stream.profile = stream.profile, None
    finally:
        genie_core.shutdown_sync()
        _servers.stop(proc)

    per_token = lambda xs: 1000 * statistics.median(xs) / new_tokens  # noqa: E731
    c = {k: statistics.median(d[k] for d in counts) for k in counts[0]}
    s = {k: statistics.median(d[k] for d in step_counts) for k in step_counts[0]}
    remote_ms, anchor_ms = per_token(remote), per_token(anchor)
    step_ratio = statistics.median(step_remote) / statistics.median(step_anchor)
    return {
        "name": "llm",
        "model": f"GPT-2 {config['n_layer']} layers x {config['n_embd']}, vocab {config['vocab_size']}, random weights",
        "new_tokens": new_tokens,
        "rounds": rounds,
        "decode_remote_ms_per_token": round(remote_ms, 2),
        "decode_batches_sent_ahead": default_pipelined,
        "decode_remote_the_other_way_ms_per_token": round(per_token(other), 2),
        "decode_on_device_ms_per_token": round(anchor_ms, 2),
        "decode_overhead_ms_per_token": round(remote_ms - anchor_ms, 2),
        "decode_round_trips_per_token": round(c["round_trips"] / new_tokens, 2),
        "decode_messages_per_token": round(c["messages"] / new_tokens, 2),
        "decode_ops_per_token": round(c["ops_sent"] / new_tokens),
        "decode_worker_ms_per_token": round(1000 * c["server_seconds"] / new_tokens, 2),
        "decode_client_ms_per_token": round(remote_ms - 1000 * c["wait_seconds"] / new_tokens, 2),
        "decode_worker_top_ops_ms_per_token": _top(decode_profile, new_tokens),
        "decode_tokens_equal_on_device": same_tokens,
        "train_step_remote_s": round(statistics.median(step_remote), 3),
        "train_step_on_device_s": round(statistics.median(step_anchor), 3),
        "train_step_ratio": round(step_ratio, 2),
        "train_step_round_trips": s["round_trips"],
        "train_step_messages": s["messages"],
        "train_step_ops": s["ops_sent"],
        "train_step_worker_s": round(s["server_seconds"], 3),
        "train_step_client_s": round(statistics.median(step_remote) - s["wait_seconds"], 3),
        "train_step_worker_top_ops_ms": _top(step_profile, 1),
        "targets": "decode: 1 round trip/token, overhead <= 2 ms/token; train step <= 1.2x on-device, 1 round trip",
        "met": {
            "round_trips_per_token": c["round_trips"] / new_tokens <= 1.0,
            "overhead": remote_ms - anchor_ms <= 2.0,
            "train_ratio": step_ratio <= 1.2,
            "train_round_trips": s["round_trips"] <= 1,
        },
    }
