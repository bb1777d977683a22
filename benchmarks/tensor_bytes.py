"""Remote-tensor bytes: `.to(remote)` and `.cpu()` of a 1 GiB tensor over each data plane, beside
a local clone of the same bytes (the same-host anchor), interleaved round by round; `model.to(remote)`
of GPT-2-small's weights (and, in a full run, GPT-2-XL-sized ones in bfloat16); a checkpoint loaded
where it lies (`torch.remote_accelerator.load`) beside the worker's own load of it. On a GPU server
also the worker's own `x.cuda()` from pageable and from pinned memory and `y.cpu()`, the anchors
there. Uploads through shared memory are timed both ways of upload segments (`shm_lent_to_remote`
or `shm_adopted_to_remote` beside the session's default: dataplane/lent.py), and `model.to` too.

Targets: on one host, `.to()` and `.cpu()` at least 0.5x a local clone (CPU server); on a GPU
server at least 1.0x the worker's own pageable `x.cuda()` / `y.cpu()`, and `model.to(remote)`
within 1.5x of `.cuda()` on the server. GENIE_TENSOR_BYTES_XL=0 leaves out the XL-sized weights (a
minute of building them on each side: the GPU check's budget)."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from unittest import mock

import torch

import genie_core
from genie_core.remote_tensor.connection import stream_for
from genie_core.remote_tensor.stream import lends_uploads

from . import _servers

GIB = 1024**3
DEV = "remote_accelerator:0"


def _server(code: str) -> dict:
    """Run `code` in the session's worker; what it leaves in `_bench` comes back."""
    client = genie_core.get_cluster_state().client
    reply = client.execute(code).wait(600).content
    if reply.get("status") != "ok":
        raise RuntimeError(f"{reply.get('ename')}: {reply.get('evalue')}")
    return client.pull(["_bench"])["_bench"]


def _each_backend(address: str, token: str, nbytes: int, rounds: int, backends: list[str]) -> dict[str, list[float]]:
    """A session on each backend in turn (a warm-up transfer first: the first of a size makes and
    faults in fresh shared memory), each round beside a local clone of the same bytes."""
    x = torch.randn(nbytes // 4)
    times: dict[str, list[float]] = {}
    for backend in backends:
        genie_core.init_sync(address, token=token, backend=backend, timeout=30)
        try:
            x.to(DEV).cpu()
            for _ in range(rounds):
                start = time.perf_counter()
                copy = x.clone()
                times.setdefault("local_clone", []).append(time.perf_counter() - start)
                del copy
                start = time.perf_counter()
                y = x.to(DEV)
                torch.remote_accelerator.synchronize()
                times.setdefault(f"{backend}_to_remote", []).append(time.perf_counter() - start)
                if backend == "shm":  # the other way of upload segments (lent on a GPU server, else adopted)
                    with _other_upload_segments() as way:
                        start = time.perf_counter()
                        other = x.to(DEV)
                        torch.remote_accelerator.synchronize()
                        times.setdefault(f"shm_{way}_to_remote", []).append(time.perf_counter() - start)
                        del other
                start = time.perf_counter()
                back = y.cpu()
                times.setdefault(f"{backend}_cpu", []).append(time.perf_counter() - start)
                assert back.shape == x.shape
                del y, back
        finally:
            genie_core.shutdown_sync()
    return times


@contextlib.contextmanager
def _other_upload_segments() -> Iterator[str]:
    """Uploads in the way of segments the session does not use by default (lent where the worker
    copies to a GPU, else adopted; dataplane/lent.py), for a comparison in the same run."""
    way = "adopted" if lends_uploads(stream_for(0).device_kind) else "lent"
    with mock.patch.dict(os.environ, {"GENIE_UPLOAD_SEGMENTS": way}):
        yield way


def _crossover(address: str, token: str, backend: str, sizes: list[int], rounds: int) -> dict[int, dict[str, float]]:
    """Median seconds for `.to(remote)` and `.cpu()` of each size, inline (in the op stream's
    messages) and over the data plane, the threshold that picks between them moved in this client
    and in the session's worker (a cell runs in the worker's process): where the data plane starts
    to win is where DATA_THRESHOLD belongs."""
    import genie_core.client.transfers as client_side

    kept = client_side.DATA_THRESHOLD
    out: dict[int, dict[str, float]] = {}
    genie_core.init_sync(address, token=token, backend=backend, timeout=30)
    try:
        for way, threshold in (("inline", 1 << 62), ("data_plane", 1)):
            client_side.DATA_THRESHOLD = threshold
            _server(f"import genie_core.worker.main as m; m.DATA_THRESHOLD = {threshold}; _bench = 0")
            for size in sizes:
                x = torch.randn(size // 4)
                x.to(DEV).cpu()  # warm: the first of a size makes fresh memory
                up, down = [], []
                for _ in range(rounds):
                    start = time.perf_counter()
                    y = x.to(DEV)
                    torch.remote_accelerator.synchronize()
                    up.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    y.cpu()
                    down.append(time.perf_counter() - start)
                    del y
                out.setdefault(size, {})[f"{way}_to"] = statistics.median(up)
                out[size][f"{way}_cpu"] = statistics.median(down)
    finally:
        client_side.DATA_THRESHOLD = kept
        genie_core.shutdown_sync()
    return out


def _model_to(config: dict, dtype: torch.dtype) -> tuple[float, float, int]:
    """Seconds for `model.to(remote)` of a GPT-2 of this shape, and for the server's own `.to()` of
    the same weights onto its device (CUDA: `.cuda()`; a CPU server: a clone); its bytes."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).to(dtype)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    start = time.perf_counter()
    model.to(DEV)
    torch.remote_accelerator.synchronize()
    remote = time.perf_counter() - start
    server = _server(f"""
import time, torch, transformers
transformers.logging.set_verbosity_error()
m = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{config!r})).to({dtype})
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
start = time.perf_counter()
moved = m.to(dev) if dev.type == "cuda" else [p.clone() for p in m.parameters()]
torch.cuda.synchronize() if dev.type == "cuda" else None
_bench = time.perf_counter() - start
del m, moved
""")
    del model
    return remote, float(server), nbytes


def _load_where_it_lies(config: dict) -> tuple[float, float]:
    """Seconds for `torch.remote_accelerator.load` of a safetensors checkpoint the worker wrote,
    and for the worker's own `load_file` of it onto its device."""
    folder = _server(f"""
import tempfile, torch, transformers
from safetensors.torch import save_file
transformers.logging.set_verbosity_error()
m = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{config!r}))
_bench = tempfile.mkdtemp()
weights = {{k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}}  # (tied)
save_file(weights, _bench + "/w.safetensors")
del m, weights
""")
    start = time.perf_counter()
    state = torch.remote_accelerator.load(f"{folder}/w.safetensors")
    torch.remote_accelerator.synchronize()
    remote = time.perf_counter() - start
    del state
    own = _server(f"""
import time, torch
from safetensors.torch import load_file
start = time.perf_counter()
w = load_file("{folder}/w.safetensors", device="cuda" if torch.cuda.is_available() else "cpu")
_bench = time.perf_counter() - start
del w
""")
    return remote, float(own)


def _gpu_anchors(nbytes: int, rounds: int) -> dict[str, float]:
    """The worker's own host-to-device copies from pageable and pinned memory and device-to-host."""
    return _server(f"""
import time, torch, statistics
x = torch.randn({nbytes // 4}); pinned = x.pin_memory()
t = {{"pageable_cuda": [], "pinned_cuda": [], "cpu": []}}
for _ in range({rounds}):
    for name, src in (("pageable_cuda", x), ("pinned_cuda", pinned)):
        torch.cuda.synchronize(); s = time.perf_counter(); y = src.cuda(); torch.cuda.synchronize()
        t[name].append(time.perf_counter() - s)
    s = time.perf_counter(); z = y.cpu(); t["cpu"].append(time.perf_counter() - s)
    del y, z
_bench = {{k: {nbytes} / statistics.median(v) / 2**30 for k, v in t.items()}}
del x, pinned
""")


def run(quick: bool = False) -> dict:
    nbytes = (64 if quick else 1024) << 20
    rounds = 2 if quick else 5
    small = {"n_layer": 2, "n_embd": 128, "n_head": 4} if quick else {}  # full: GPT-2 small (124M)
    proc, info = _servers.start()
    address = f"{info.ip}:{info.port}"
    try:
        genie_core.init_sync(address, token=info.token, timeout=30)
        client = genie_core.get_cluster_state().client
        on_gpu = bool(client.node.get("gpus")) and not client.node.get("simulated_gpus")
        backends = [c.name for c in client.transfers.report.candidates if c.available and c.name in ("shm", "tcp")]
        chosen = client.transfers.channel.name  # what discovery chose: the targets are judged on it
        discovery = client.transfers.report.reason if client.transfers.report else ""  # with every rate probed
        genie_core.shutdown_sync()
        times = _each_backend(address, info.token, nbytes, rounds, [*backends, "zmq"])
        sizes = [64 << 10, 1 << 20, 4 << 20] if quick else [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
        crossover = {b: _crossover(address, info.token, b, sizes, 3 if quick else 15) for b in backends}
        genie_core.init_sync(address, token=info.token, timeout=30)
        torch.ones(1, device=DEV).cpu()  # the session's worker up, torch imported there
        rate = {k: nbytes / statistics.median(v) / GIB for k, v in times.items()}
        out: dict = {
            "name": "tensor_bytes",
            "mib": nbytes >> 20,
            "rounds": rounds,
            "server": "GPU" if on_gpu else "CPU",
        }
        out.update({f"{k}_gib_s": round(v, 3) for k, v in rate.items()})
        anchor = rate["local_clone"]
        for backend in backends:
            out[f"{backend}_to_remote_vs_clone"] = round(rate[f"{backend}_to_remote"] / anchor, 2)
            out[f"{backend}_cpu_vs_clone"] = round(rate[f"{backend}_cpu"] / anchor, 2)
        for backend, by_size in crossover.items():  # the data plane's time over inline's, per size
            for size, t in by_size.items():
                label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
                out[f"{backend}_vs_inline_{label}"] = (
                    f"to {t['data_plane_to'] / t['inline_to']:.2f}, cpu {t['data_plane_cpu'] / t['inline_cpu']:.2f}"
                )
        with _other_upload_segments() as way:
            out[f"gpt2_small_model_to_remote_{way}_s"] = round(_model_to(small, torch.float32)[0], 3)
        remote, server, size = _model_to(small, torch.float32)
        out["gpt2_small_mib"] = size >> 20
        out["gpt2_small_model_to_remote_s"] = round(remote, 3)
        out["gpt2_small_to_on_the_server_s"] = round(server, 3)
        out["gpt2_small_model_to_vs_server"] = round(remote / server, 2)
        if not quick and os.environ.get("GENIE_TENSOR_BYTES_XL", "1") != "0":  # GPT-2-XL-sized, bfloat16 (3 GiB)
            xl = {"n_layer": 48, "n_embd": 1600, "n_head": 25}
            remote, server, size = _model_to(xl, torch.bfloat16)
            out["gpt2_xl_bf16_mib"] = size >> 20
            out["gpt2_xl_bf16_model_to_remote_s"] = round(remote, 3)
            out["gpt2_xl_bf16_to_on_the_server_s"] = round(server, 3)
        remote, own = _load_where_it_lies(small)
        out["load_where_it_lies_s"] = round(remote, 3)
        out["workers_own_load_s"] = round(own, 3)
        if on_gpu:
            gpu = _gpu_anchors(nbytes, rounds)
            out.update({f"worker_{k}_gib_s": round(v, 3) for k, v in gpu.items()})
        out["targets"] = (
            "one host (CPU server): .to() and .cpu() >= 0.5 x a local clone; GPU server: >= 1.0 x the worker's "
            "own pageable .cuda() / .cpu(), model.to(remote) <= 1.5 x .cuda() on the server"
        )
        best = chosen if f"{chosen}_to_remote" in rate else "zmq"
        out["chosen_backend"] = best
        out["discovery"] = discovery
        if on_gpu:
            out["met"] = {
                "to_vs_pageable_cuda": rate[f"{best}_to_remote"] >= gpu["pageable_cuda"],
                "cpu_vs_worker_cpu": rate[f"{best}_cpu"] >= gpu["cpu"],
                "model_to_within_1.5x": out["gpt2_small_model_to_vs_server"] <= 1.5,
            }
        else:
            out["met"] = {
                "to_vs_clone": rate[f"{best}_to_remote"] >= 0.5 * anchor,
                "cpu_vs_clone": rate[f"{best}_cpu"] >= 0.5 * anchor,
            }
    finally:
        genie_core.shutdown_sync()
        _servers.stop(proc)
    return out
