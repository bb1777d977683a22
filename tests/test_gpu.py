"""The remote_accelerator suites against a server whose device is a CUDA GPU (`-m gpu`; skipped
without one). Values are compared within tolerance here (another device's kernels), tokens and
integer results exactly; autocast against the same code under the server's own CUDA autocast."""

from __future__ import annotations

import os
import time

import pytest
import torch

import genie_core

pytestmark = pytest.mark.gpu
DEV = "remote_accelerator:0"
WORKERS = int(os.environ.get("GENIE_CONFORMANCE_WORKERS", "2"))  # client processes for OpInfo and ModuleInfo


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    from conftest import start_server

    srv = start_server(tmp_path_factory.mktemp("gpu-server"), "--gpus", "0")
    genie_core.init_sync(f"127.0.0.1:{srv.info.port}", token=srv.info.token, timeout=30)
    client = genie_core.get_cluster_state().client
    # Full float32 matmuls and convolutions on the server, as on the CPU it is compared with.
    setup = "import torch; torch.backends.cuda.matmul.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = False"
    assert client.execute(setup).wait(60).content["status"] == "ok"
    yield srv
    genie_core.shutdown_sync()
    srv.stop()


def _server(code: str) -> None:
    reply = genie_core.get_cluster_state().client.execute(code).wait(300).content
    assert reply["status"] == "ok", reply


@pytest.mark.timeout(1200)
def test_opinfo_database_on_a_gpu_server(tmp_path):
    pytest.importorskip("expecttest")
    import opinfo_conformance as conformance
    from conftest import start_server

    srv = start_server(tmp_path, "--gpus", "0")
    try:
        start = time.perf_counter()
        results = conformance.run(f"127.0.0.1:{srv.info.port}", srv.info.token, workers=WORKERS, gpu=True)
        seconds = time.perf_counter() - start
    finally:
        srv.stop()
    conformance.write_section(
        "opinfo-gpu",
        conformance.document(
            results,
            seconds,
            torch.cuda.get_device_name(0),
            title="PyTorch OpInfo database on a GPU server",
            workers=WORKERS,
        ),
    )
    rates = conformance.rates(results)
    failing = {
        (r["op"], mode): conformance.outcome(r, mode)
        for r in results
        for mode in ("forward", "backward")
        if conformance.outcome(r, mode)[0] in ("wrong", "crash")
    }
    assert not failing, f"wrong results or crashes: {failing}"
    assert rates["forward"]["rate"] >= 0.98, rates["forward"]
    assert rates["backward"]["rate"] >= 0.95, rates["backward"]


# A GPU's float32 result against the CPU's (TF32 off on the server, see gpu_server): the same
# operations with sums reduced in other orders. Outputs of a two-layer model differ by a few float32
# ulps of their largest values, so: relative 1e-4 and absolute 1e-5 (torch.testing's float32
# default is 1.3e-6 and 1e-5: one op's worth of rounding). A gradient is a sum of many products that
# may cancel: a near-zero gradient's relative error is large, so gradients are compared against
# the largest of their tensor (relative 1e-3 of it). AdamW's first step moves each parameter by
# about lr whatever its gradient's size (m / sqrt(v) is about +-1), so a gradient that is zero but
# for rounding moves a parameter by up to lr either way: parameters after the step are compared
# within lr, and the gradients above are the real check of what the step used.
OUTPUT = {"rtol": 1e-4, "atol": 1e-5}
LR = 1e-3


@pytest.mark.timeout(900)
def test_module_database_on_a_gpu_server(tmp_path):
    pytest.importorskip("expecttest")
    import opinfo_conformance as conformance
    import test_conformance_modules as modules
    from conftest import start_server

    srv = start_server(tmp_path, "--gpus", "0")
    try:
        start = time.perf_counter()
        results = conformance.run(
            f"127.0.0.1:{srv.info.port}", srv.info.token, workers=WORKERS, gpu=True, kind="modules"
        )
        seconds = time.perf_counter() - start
    finally:
        srv.stop()
    text = modules.document(results, seconds, torch.cuda.get_device_name(0), WORKERS).replace(
        "## PyTorch ModuleInfo database", "## ModuleInfo on a GPU server"
    )
    conformance.write_section("modules-gpu", text)
    failing = {
        (r["op"], mode): conformance.outcome(r, mode)
        for r in results
        for mode in ("forward", "backward")
        if conformance.outcome(r, mode)[0] in ("wrong", "crash")
    }
    assert not failing, f"wrong results or crashes: {failing}"
    rates = conformance.rates(results)
    assert rates["forward"]["rate"] >= 0.95 and rates["backward"]["rate"] >= 0.95, rates


def _close(remote_value: torch.Tensor, local: torch.Tensor, what: str, **tolerance: float) -> None:
    got = remote_value.detach().cpu()
    assert got.dtype == local.dtype and got.shape == local.shape, what
    torch.testing.assert_close(got, local.detach(), **(tolerance or OUTPUT), msg=lambda m: f"{what}: {m}")


def _without_dropout(model: torch.nn.Module) -> None:
    """Dropout off in every form a model uses: nn.Dropout modules, and the rates modules keep for
    functional dropout (T5's attention: `self.dropout = config.dropout_rate`; attention_dropout)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)


# (Mixtral is left out: its experts use torch._grouped_mm, which CUDA runs in bfloat16 only.)
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "bert", "t5", "vit", "resnet"])
def test_models_on_a_gpu_server(gpu_server, kind):
    transformers = pytest.importorskip("transformers")
    import test_conformance_models as models

    transformers.logging.set_verbosity_error()
    build = models._decoder if kind in ("gpt2", "llama", "qwen2", "mixtral") else models._other
    local, model = models.twins(build, kind)
    inputs = models.batch(kind)
    local.eval(), model.eval()
    with torch.no_grad():
        _close(model(**models.on(inputs, DEV)).logits, local(**inputs).logits, "logits")
    for m in (local, model):  # the CPU's and CUDA's generators draw different masks: no dropout at all
        m.train()
        _without_dropout(m)
    torch.manual_seed(1)
    first = local(**inputs).loss
    torch.manual_seed(2)
    assert torch.equal(local(**inputs).loss, first), "a dropout is still on: train-mode losses differ by seed"
    opt_local, opt = torch.optim.AdamW(local.parameters(), lr=LR), torch.optim.AdamW(model.parameters(), lr=LR)
    loss_local, loss = local(**inputs).loss, model(**models.on(inputs, DEV)).loss
    loss_local.backward(), loss.backward()
    _close(loss, loss_local, "loss")
    # Each gradient within 1e-3 of its own largest element, or of a hundred-thousandth of the
    # model's largest gradient where its own is smaller: a gradient that is zero in exact arithmetic
    # (an attention key's bias, which softmax cancels) is rounding noise, 1e-11 to 1e-10 of the largest
    # on the CPU and more on a GPU, while the smallest real ones (BERT's query bias) are 4e-5 of it.
    largest = max(p.grad.abs().max().item() for p in local.parameters() if p.grad is not None)

    def scale_of(grad: torch.Tensor) -> float:
        return max(grad.abs().max().item(), 1e-5 * largest)

    for (name, p), q in zip(local.named_parameters(), model.parameters(), strict=True):
        if p.grad is not None:
            _close(q.grad, p.grad, f"{name}'s gradient", rtol=0.0, atol=1e-3 * scale_of(p.grad))
    opt_local.step(), opt.step()
    for (name, p), q in zip(local.named_parameters(), model.parameters(), strict=True):
        _close(q, p, f"{name} after an AdamW step", rtol=0.0, atol=LR)
        if p.grad is not None:  # the step's moments are the gradients' (and their squares'): checked as they are
            scale = scale_of(p.grad)
            mine, theirs = opt_local.state[p], opt.state[q]
            _close(theirs["exp_avg"], mine["exp_avg"], f"{name}'s first moment", rtol=0.0, atol=1e-3 * scale)
            _close(theirs["exp_avg_sq"], mine["exp_avg_sq"], f"{name}'s second moment", rtol=0.0, atol=2e-3 * scale**2)
    if kind in ("gpt2", "llama", "qwen2", "t5"):
        local.eval(), model.eval()
        prompt = {k: v for k, v in inputs.items() if k != "labels"}
        for options in (
            {"do_sample": False},
            {"num_beams": 3, "do_sample": False},
            {"do_sample": False, "cache_implementation": "static"},
        ):
            kwargs = dict(max_new_tokens=6, min_new_tokens=6, **options)
            assert torch.equal(
                model.generate(**models.on(prompt, DEV), **kwargs).cpu(), local.generate(**prompt, **kwargs)
            ), options


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_equals_the_servers_own_cuda_autocast(gpu_server, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 10),
        torch.nn.LogSoftmax(-1),
    )
    inp = torch.randn(4, 3, 8, 8)
    client = genie_core.get_cluster_state().client
    client.push({"state": model.state_dict(), "inp": inp})
    name = str(dtype).removeprefix("torch.")
    _server(f"""
import torch
m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
                        torch.nn.Linear(8 * 6 * 6, 10), torch.nn.LogSoftmax(-1)).cuda()
m.load_state_dict(state)
with torch.autocast("cuda", dtype=torch.{name}):
    native = m(inp.cuda())
native = native.cpu()
""")
    expected = client.pull(["native"])["native"]
    remote = model.to(DEV)
    with torch.autocast("remote_accelerator", dtype=dtype):
        out = remote(inp.to(DEV))
    assert out.dtype == expected.dtype
    assert torch.equal(out.cpu(), expected)  # the same casts, run by the same device


def test_compiled_static_cache_decode_with_inductor_and_cuda_graphs(gpu_server):
    """The fast-decoding recipe on a GPU server: the server's Inductor compiles the forward
    (mode="reduce-overhead": its CUDA graphs, parameters and buffers marked static)."""
    transformers = pytest.importorskip("transformers")
    import test_conformance_models as models

    transformers.logging.set_verbosity_error()
    local, model = models.twins(models._decoder, "gpt2")
    local.eval(), model.eval()
    prompt = {k: v for k, v in models.batch("gpt2").items() if k != "labels"}
    kwargs = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
    eager_tokens = model.generate(**models.on(prompt, DEV), **kwargs).cpu()
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # Inductor's CUDA graphs record on the second call and replay after
        tokens = model.generate(**models.on(prompt, DEV), **kwargs).cpu()
        assert torch.equal(tokens, eager_tokens)
    assert torch.equal(tokens, local.generate(**prompt, **kwargs))
    counters = "__import__('torch')._dynamo.utils.counters"
    assert _value(f"{counters}['stats']['unique_graphs']") >= 1
    assert _value(f"{counters}['inductor']['cudagraph_skips']") == 0  # Inductor's CUDA graphs were used


def test_a_captured_graph_replays_as_a_cuda_graph(gpu_server):
    ra = torch.remote_accelerator
    w = torch.randn(64, 64)
    static_x, wr = torch.zeros(8, 64, device=DEV), w.to(DEV)
    torch.relu(static_x @ wr).cpu()  # warm up (cuBLAS) before the capture, as CUDA graphs want
    g = ra.CUDAGraph()
    with ra.graph(g):
        static_y = torch.relu(static_x @ wr) * 2
    for _ in range(3):
        x = torch.randn(8, 64)
        static_x.copy_(x)
        g.replay()
        _close(static_y, torch.relu(x @ w) * 2, "replayed output")
    held = (
        "sum(o.cuda_graph is not None for o in __import__('gc').get_objects() if type(o).__name__ == 'CapturedGraph')"
    )
    assert _value(held) >= 1


def test_gpu_memory_is_returned_after_del_and_after_the_session(gpu_server):
    import gc

    gc.collect()  # tensors earlier tests let go: their frees go with the next batch, before `before`
    torch.remote_accelerator.synchronize()
    before = _value("torch.cuda.memory_allocated()")
    x = torch.empty(256, 1024, 1024, device=DEV)  # 1 GiB
    torch.remote_accelerator.synchronize()
    assert _value("torch.cuda.memory_allocated()") >= before + 2**30
    assert torch.remote_accelerator.memory_allocated() >= before + 2**30  # the device module's, and torch.accelerator's
    assert torch.accelerator.memory_allocated() == torch.remote_accelerator.memory_allocated()
    assert "Allocated memory" in torch.remote_accelerator.memory_summary()  # CUDA's own report
    del x
    torch.remote_accelerator.synchronize()  # the free travels with the next batch
    assert _value("torch.cuda.memory_allocated()") <= before
    y = torch.empty(256, 1024, 1024, device=DEV)
    torch.remote_accelerator.synchronize()
    free_during = torch.cuda.mem_get_info(0)[0]
    genie_core.shutdown_sync()  # the session's worker ends: its memory goes back to the device
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and torch.cuda.mem_get_info(0)[0] < free_during + 2**30:
        time.sleep(0.5)
    assert torch.cuda.mem_get_info(0)[0] >= free_during + 2**30
    del y
    genie_core.init_sync(f"127.0.0.1:{gpu_server.info.port}", token=gpu_server.info.token, timeout=30)


def _value(expression: str) -> int:
    client = genie_core.get_cluster_state().client
    _server(f"import torch\n_genie_value = int({expression})")
    return int(client.pull(["_genie_value"])["_genie_value"])


def _fetched(t: torch.Tensor, inline: bool = False) -> torch.Tensor:
    """What a fetch of `t` sends (host_copies.serialized), written into a staging segment in
    /dev/shm (or, `inline`, memory of its own) and read back as a client would."""
    from genie_core.dataplane.segment import LateBuffer, Segment, buffer_size, pack_into, split
    from genie_core.serialize import deserialize
    from genie_core.worker import host_copies

    meta, buffers = host_copies.serialized(t)
    if inline:
        return deserialize(meta, [b.host() if isinstance(b, LateBuffer) else b for b in buffers])
    sizes = [buffer_size(b) for b in buffers]
    segment = Segment.create("genie-t", sum(sizes))
    try:
        done: list[int] = []
        pack_into(segment.view, buffers, progress=lambda n, total: done.append(n))
        assert done == sorted(done) and done[-1] == sum(sizes)
        return deserialize(meta, split(segment.view, sizes)).clone()
    finally:
        segment.unlink()


@pytest.mark.parametrize("way", ["ring", "register", "pageable"])
def test_host_copies_keep_every_byte_and_layout(way, monkeypatch):
    """The worker's copies between host memory and the GPU (worker/host_copies.py), each way: several
    staging chunks and a partial one, dtypes of 1, 2, 8 bytes, a permuted layout; a fetch of part of
    a storage, of a conjugate view, written where it is sent from or into memory of its own; ordered
    with the device's current stream both ways (an upload read by a kernel at once; a download of
    what a long kernel is still writing)."""
    from genie_core.worker import host_copies

    monkeypatch.setenv("GENIE_HOST_COPIES", way)
    dev = torch.device("cuda", 0)
    n = 2 * host_copies.CHUNK + 12_345
    cases = [
        torch.randn(n // 4),
        torch.randn(1500, 1100).t(),
        torch.randint(0, 2, (n,), dtype=torch.bool),
        torch.randn(n // 2, dtype=torch.bfloat16),
        torch.randn(n // 8, dtype=torch.complex64),
    ]
    for host in cases:
        on = host_copies.to_device(host, dev)
        assert on.device == dev and on.stride() == host.stride() and on.dtype == host.dtype
        assert torch.equal(on.cpu(), host), f"{host.dtype} {tuple(host.stride())} upload"
        assert torch.equal(_fetched(on), host), f"{host.dtype} {tuple(host.stride())} fetch"
    big = torch.randn(n // 4, device=dev)
    part = big[1000 : 1000 + (3 << 20)]
    assert torch.equal(_fetched(part), part.cpu())
    z = torch.randn(n // 8, dtype=torch.complex64, device=dev).conj()
    assert torch.equal(_fetched(z), z.cpu())
    assert torch.equal(_fetched(z.imag), z.imag.cpu())  # a view with the neg bit
    assert torch.equal(_fetched(z.imag, inline=True), z.imag.cpu())
    weight = torch.nn.Parameter(torch.randn(n // 4, device=dev))
    assert _fetched(weight).requires_grad and torch.equal(_fetched(weight).detach(), weight.detach().cpu())
    host = torch.randn(n // 4)
    assert torch.equal((host_copies.to_device(host, dev) * 2).cpu(), host * 2)
    with torch.cuda.stream(torch.cuda.Stream()):  # another current stream: ordered with it too
        twice = host_copies.to_device(host, dev) * 2
        assert torch.equal(_fetched(twice), host * 2)
    a = torch.randn(4096, 4096, device=dev)
    slow = a @ a @ a @ a  # still running when the download is asked for
    assert torch.equal(_fetched(slow), slow.cpu())


def test_big_tensors_both_ways_to_a_gpu_server(gpu_server):
    """Bytes over the data plane into the GPU and back (worker/host_copies.py), an op between."""
    x = torch.randn(40 << 18)  # 40 MiB
    y = x.to(DEV) * 3
    assert torch.equal(y.cpu(), x * 3)
    assert torch.equal(y[5:].cpu(), (x * 3)[5:])  # a view that starts inside its storage
    m = torch.randn(2048, 1500)
    assert torch.equal(m.to(DEV).t().cpu(), m.t())  # a transposed one
    # pulled from the session's namespace: its bytes straight from the GPU into the segment too
    client = genie_core.get_cluster_state().client
    _server("import torch\ng = torch.arange(40 << 18, device='cuda', dtype=torch.float32)")
    assert torch.equal(client.pull(["g"])["g"], torch.arange(40 << 18, dtype=torch.float32))
