"""`torch.compile` on remote_accelerator against a real CPU server: Dynamo traces here, the graph
goes to the server once and runs there, one recorded op a call. Results are compared bit for bit
with the same code run eagerly on the CPU (the server runs the captured graph as it is, with
`options={"compiler": "eager"}`, unless a test says otherwise)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_remote_tensor import MLP

from genie_core.remote_tensor import compiler

DEV = "remote_accelerator:0"
EAGER = {"backend": "remote_accelerator", "options": {"compiler": "eager"}}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def stats() -> dict:
    return torch.remote_accelerator.stats()["0"]


class Recorded:
    """The records a stream sends, by kind, while in the block."""

    def __init__(self) -> None:
        from genie_core.remote_tensor.connection import stream_for

        self.stream = stream_for(0)
        self.kinds: list[str] = []

    def __enter__(self) -> Recorded:
        original = self.stream.record

        def record(entry: tuple) -> None:
            self.kinds.append(entry[0] if entry[0] != "call" else f"call:{entry[1]}")
            original(entry)

        self.stream.record = record
        return self

    def __exit__(self, *exc: object) -> None:
        del self.stream.record


def twins(build, seed: int = 0):
    torch.manual_seed(seed)
    local = build()
    return local, copy.deepcopy(local).to(DEV)


def test_a_compiled_call_is_one_recorded_op_and_the_graph_goes_once(remote):
    local, model = twins(MLP)
    compiled = torch.compile(model, **EAGER)
    x = torch.randn(8, 16)
    xr = x.to(DEV)
    with torch.no_grad(), Recorded() as sent:
        first = compiled(xr)
        second = compiled(xr)
        before = stats()["round_trips"]
        assert torch.equal(second.cpu(), local(x))
        assert stats()["round_trips"] == before + 1  # both calls and the value: one round trip
        assert torch.equal(first.cpu(), local(x))
    assert sent.kinds.count("graph") == 1  # the graph itself, once
    assert sent.kinds.count("call:graph") == 2  # each call: one op
    assert not [k for k in sent.kinds if k == "op"]  # nothing recorded op by op


def test_the_default_backend_compiles_on_the_server_with_inductor(remote):
    """`torch.compile(f)` with no backend: the graph goes to the server, whose Inductor compiles it
    (Dynamo's graph count in the session's worker goes up; the eager compiler leaves it)."""
    from conftest import run, stdout_of

    import genie_core

    client = genie_core.get_cluster_state().client
    count = "from torch._dynamo.utils import counters; print(counters['stats']['unique_graphs'])"
    x = torch.arange(4.0).to(DEV)
    assert torch.equal(torch.compile(lambda t: t * 3, **EAGER)(x).cpu(), torch.arange(4.0) * 3)
    before = int(stdout_of(run(client, count)))
    graphs = compiler.stats["graphs"]
    assert torch.equal(torch.compile(lambda t: t * 2 + 1)(x).cpu(), torch.arange(4.0) * 2 + 1)
    # a graph with no remote input that makes its tensors on the device goes there too
    assert torch.equal(torch.compile(lambda n: torch.arange(n, device=DEV) * 2)(5).cpu(), torch.arange(5) * 2)
    assert compiler.stats["graphs"] == graphs + 2
    assert int(stdout_of(run(client, count, timeout=120))) == before + 2


class Block(nn.Module):
    """nanoGPT's block, as people write it."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT's model: positions made in forward on the input's device, tied embeddings."""

    def __init__(self, vocab: int = 50, block: int = 16, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_nanogpt_compiled_forward_and_training_steps_equal_the_cpu(remote):
    local, model = twins(GPT)
    compiled = torch.compile(model, **EAGER)
    g = torch.Generator().manual_seed(3)
    idx, targets = torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g)
    with torch.no_grad():
        assert torch.equal(compiled(idx.to(DEV))[0].cpu(), local(idx)[0])
    opt_local = torch.optim.AdamW(local.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        loss_local = local(idx, targets)[1]
        loss = compiled(idx.to(DEV), targets.to(DEV))[1]
        loss_local.backward(), loss.backward()
        assert torch.equal(loss.cpu(), loss_local.detach())
        for p, q in zip(local.parameters(), model.parameters(), strict=True):
            assert torch.equal(q.grad.cpu(), p.grad)
        opt_local.step(), opt.step()
        opt_local.zero_grad(), opt.zero_grad()
    for p, q in zip(local.parameters(), model.parameters(), strict=True):
        assert torch.equal(q.cpu(), p.detach())


class Branchy(nn.Module):
    """A print and a branch on a value: Dynamo breaks the graph at both."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        print("between the layers")
        if y.sum() > 0:
            return self.b(y) * 2
        return self.b(y) - 1


def test_graph_breaks_run_the_rest_eagerly_and_stay_correct(remote, capsys):
    local, model = twins(Branchy, seed=1)
    compiled = torch.compile(model, **EAGER)
    graphs = compiler.stats["graphs"]
    for sign in (1.0, -1.0):
        x = sign * torch.rand(3, 4) * 10
        with torch.no_grad():
            assert torch.equal(compiled(x.to(DEV)).cpu(), local(x))
    assert compiler.stats["graphs"] > graphs + 1  # a graph on each side of the break, and each branch
    assert capsys.readouterr().out.count("between the layers") == 4  # printed here, as eager code is


def test_a_new_shape_recompiles_and_dynamic_shapes_keep_one_graph(remote):
    f = torch.compile(lambda x: (x * 2).sum(0) + x[0], dynamic=False, **EAGER)
    graphs = compiler.stats["graphs"]
    for n in (3, 5):
        x = torch.randn(n, 4)
        assert torch.equal(f(x.to(DEV)).cpu(), (x * 2).sum(0) + x[0])
    assert compiler.stats["graphs"] == graphs + 2  # one per shape, as on CUDA

    g = torch.compile(lambda x: (x * 2).reshape(-1)[: x.shape[0] + 1].cumsum(0), dynamic=True, **EAGER)
    graphs = compiler.stats["graphs"]
    for n in (3, 5, 9):
        x = torch.randn(n, 4)
        out = g(x.to(DEV))
        assert out.shape == (n + 1,)  # the output's size, from the symbolic one, before any round trip
        assert torch.equal(out.cpu(), (x * 2).reshape(-1)[: n + 1].cumsum(0))
    assert compiler.stats["graphs"] == graphs + 1


def test_cpu_inputs_and_outputs_of_a_graph(remote):
    def f(x, scale):
        y = x * scale.to(x.device)  # a CPU tensor moved inside the graph
        return y.sum(), y.cpu()  # and one that comes back

    compiled = torch.compile(f, **EAGER)
    x, scale = torch.randn(3, 3), torch.tensor(2.5)
    total, back = compiled(x.to(DEV), scale)
    assert total.device == torch.device(DEV) and back.device == torch.device("cpu")
    assert torch.equal(back, x * scale) and torch.equal(total.cpu(), (x * scale).sum())


def test_an_error_only_the_server_sees_is_raised_at_the_next_value(remote):
    def f(x, index):
        return x[index] + 1

    compiled = torch.compile(f, **EAGER)
    x = torch.zeros(4).to(DEV)
    out = compiled(x, torch.tensor([7]).to(DEV))  # out of range: only the server can tell
    with pytest.raises(Exception, match=r"remote op graph .*index 7 is out of bounds"):
        out.cpu()
    assert torch.equal(compiled(x, torch.tensor([2]).to(DEV)).cpu(), torch.ones(1))  # the session goes on


def test_a_compiler_the_server_does_not_have_is_refused_at_compile(remote):
    f = torch.compile(lambda x: x + 1, backend="remote_accelerator", options={"compiler": "tvm"})
    with pytest.raises(Exception, match="options\\['compiler'\\] is 'tvm'; the server compiles with one of"):
        f(torch.zeros(2).to(DEV))


def test_a_training_step_compiled_by_the_servers_inductor(remote):
    """The default backend in training: Inductor compiles forward and backward on the server (its
    backward donates buffers, so it runs with retain_graph only when the client's backward asks)."""
    local, model = twins(MLP)
    compiled = torch.compile(model)
    x = torch.randn(8, 16)
    loss = compiled(x.to(DEV)).pow(2).sum()
    loss.backward()
    local(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad)  # (Inductor's kernels round differently)
    with pytest.raises(Exception, match="retain_graph=False"):  # as on the client's own device
        loss = compiled(x.to(DEV)).pow(2).sum()
        loss.backward(retain_graph=True)
        model.net[0].weight.grad.cpu()


def test_gradients_of_views_and_cpu_inputs_through_a_compiled_graph(remote):
    """Inputs that are slices of one tensor (q, k, v = qkv.split(...) outside the graph) and a CPU
    input that wants a gradient: each gets its gradient, where and how eager gives it."""
    f = torch.compile(lambda q, k, v, s: ((q @ k.transpose(-1, -2)) * s).softmax(-1) @ v, **EAGER)
    qkv = torch.randn(2, 4, 24)
    scale = torch.tensor(0.5, requires_grad=True)
    remote_qkv = qkv.to(DEV).requires_grad_()
    out = f(*remote_qkv.split(8, dim=-1), scale)
    out.sum().backward()
    local_qkv = qkv.clone().requires_grad_()
    local_scale = torch.tensor(0.5, requires_grad=True)
    expected = ((local_qkv[..., :8] @ local_qkv[..., 8:16].transpose(-1, -2)) * local_scale).softmax(-1)
    (expected @ local_qkv[..., 16:]).sum().backward()
    assert torch.allclose(remote_qkv.grad.cpu(), local_qkv.grad, atol=1e-6)
    assert scale.grad is not None and scale.grad.device.type == "cpu"
    assert torch.allclose(scale.grad, local_scale.grad, atol=1e-6)
    x = torch.randn(3).to(DEV).requires_grad_()
    (grad,) = torch.autograd.grad(torch.compile(lambda t: (t**3).sum(), **EAGER)(x), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"double backward .* is not supported"):  # else silently wrong
        grad.cpu()


def test_numbers_of_other_types_are_other_ops(remote):
    """1, 1.0 and True are equal Python keys and give other dtypes: the caches tell them apart."""
    assert torch.arange(5, device=DEV).dtype == torch.int64
    assert torch.arange(5.0, device=DEV).dtype == torch.float32
    assert torch.equal(torch.arange(5.0, device=DEV).cpu(), torch.arange(5.0))
    n = torch.arange(4).to(DEV)
    assert (n**2).dtype == torch.int64 and (n**2.0).dtype == torch.float32
    assert torch.equal((n**2.0).cpu(), torch.arange(4) ** 2.0)
    assert torch.full((2,), True, device=DEV).dtype == torch.bool
    assert torch.full((2,), 1, device=DEV).dtype == torch.int64


def test_graphs_that_ask_for_cuda_graphs_are_compiled_without_graph_trees(monkeypatch):
    """The worker compiles a graph that asks for CUDA graphs with Inductor's graph trees off (on an
    H100 with torch 2.11 their warm-up segfaulted the worker: benchmarks/RESULTS.md), unless the
    client asked for trees by name. (CUDA graphs need a GPU: torch.compile is replaced by a spy
    that records the options the worker passes it.)"""
    from genie_core.worker import compiled

    asked = []
    monkeypatch.setattr(compiled.torch, "compile", lambda module, **kw: asked.append(kw["options"]) or module)
    for options in ({"triton.cudagraphs": True}, {"triton.cudagraphs": True, "triton.cudagraph_trees": True}, {}):
        compiled._Graph(nn.Identity(), {"compiler": "inductor", "options": options, "dynamic": None}).function()
    assert asked == [
        {"triton.cudagraphs": True, "triton.cudagraph_trees": False},
        {"triton.cudagraphs": True, "triton.cudagraph_trees": True},
        None,
    ]


def test_a_graph_with_a_bytes_constant_is_refused_clearly():
    """Bytes in an op's record name a remote tensor: a graph holding a bytes constant is refused
    when it is encoded, not misread by the worker."""
    import operator

    from genie_core.protocol import fx_graph

    graph = torch.fx.Graph()
    graph.output(graph.call_function(operator.add, (graph.placeholder("x"), b"ab")))
    with pytest.raises(NotImplementedError, match="bytes constant"):
        fx_graph.encode(torch.fx.GraphModule(torch.nn.Module(), graph), lambda value: value)
