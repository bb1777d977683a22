"""Captured graphs on remote_accelerator (`torch.remote_accelerator.graph`, `CUDAGraph`,
`make_graphed_callables`), as code written for CUDA graphs uses them, against a real CPU server:
replays equal eager CPU bit for bit, and a replay is one record, whatever the graph holds."""

from __future__ import annotations

import copy

import pytest
import torch

DEV = "remote_accelerator:0"
ra = None


@pytest.fixture(autouse=True)
def _module(remote):
    global ra
    ra = torch.remote_accelerator


def sent_kinds(stream, block):
    kinds: list[str] = []
    original = stream.record

    def record(entry: tuple) -> None:
        kinds.append(entry[0])
        original(entry)

    stream.record = record
    try:
        block()
    finally:
        del stream.record
    return kinds


def test_a_replay_is_one_record_and_its_outputs_are_static():
    from genie_core.remote_tensor.connection import stream_for

    w = torch.randn(4, 4)
    static_x, wr = torch.zeros(3, 4, device=DEV), w.to(DEV)
    g = ra.CUDAGraph()
    with ra.graph(g):
        h = static_x @ wr
        for _ in range(50):  # a graph of 100 ops
            h = torch.tanh(h) * 1.01
        static_y = h + 1
    row = static_y[0]  # a view taken after the capture follows the replays, as on CUDA
    stream = stream_for(0)
    for _ in range(3):
        x = torch.randn(3, 4)
        static_x.copy_(x)
        kinds = sent_kinds(stream, g.replay)
        assert kinds == ["replay"]
        before = ra.stats()["0"]["round_trips"]
        expected = x @ w
        for _ in range(50):
            expected = torch.tanh(expected) * 1.01
        assert torch.equal(static_y.cpu(), expected + 1)
        assert ra.stats()["0"]["round_trips"] == before + 1
        assert torch.equal(row.cpu(), (expected + 1)[0])


def test_a_value_needed_in_a_capture_is_refused_as_cuda_refuses_it():
    x = torch.ones(3, device=DEV)
    assert not ra.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="not permitted while a graph is being captured"), ra.graph(ra.CUDAGraph()):
        assert ra.is_current_stream_capturing()
        (x * 2).sum().item()
    assert not ra.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="not permitted while a graph is being captured"), ra.graph(ra.CUDAGraph()):
        torch.nonzero(x)  # an output shape that only the server knows: a question answered at once
    assert not ra.is_current_stream_capturing()
    assert torch.equal((x + 1).cpu(), torch.full((3,), 2.0))  # the session goes on
    with ra.graph(ra.CUDAGraph()), pytest.raises(RuntimeError, match="already being captured"):
        ra.CUDAGraph().capture_begin()
    with pytest.raises(RuntimeError, match="has not been captured"):
        ra.CUDAGraph().replay()


def test_a_reset_graph_is_gone_from_the_server():
    x = torch.ones(2, device=DEV)
    g = ra.CUDAGraph()
    with ra.graph(g):
        y = x * 3
    g.replay()
    assert torch.equal(y.cpu(), torch.full((2,), 3.0))
    g.reset()
    with pytest.raises(RuntimeError, match="has not been captured"):
        g.replay()


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def test_make_graphed_callables_trains_as_eager_does():
    torch.manual_seed(0)
    local = MLP()
    model = copy.deepcopy(local).to(DEV)
    sample = (torch.randn(5, 6, device=DEV),)
    graphed = ra.make_graphed_callables(model, sample)
    assert graphed is model
    opt_local = torch.optim.SGD(local.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    from genie_core.remote_tensor.connection import stream_for

    for _ in range(3):
        x = torch.randn(5, 6, generator=g)
        xr = x.to(DEV)
        out, out_local = None, local(x)

        def forward(xr=xr) -> None:
            nonlocal out
            out = graphed(xr)

        kinds = sent_kinds(stream_for(0), forward)
        assert set(kinds) == {"op", "replay"} and kinds.count("replay") == 1  # the model's ops: not one
        assert kinds.count("op") == 2  # the input's copy into the static one, and the output's detach
        (out**2).sum().backward()
        (out_local**2).sum().backward()
        assert torch.equal(out.cpu(), out_local.detach())
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            assert torch.equal(p.grad.cpu(), q.grad)
        opt.step(), opt_local.step()
        opt.zero_grad(), opt_local.zero_grad()
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.cpu(), q.detach())
    model.eval()
    assert torch.equal(model(sample[0]).cpu(), local.eval()(sample[0].cpu()))  # eval: the module's own forward


def test_a_graph_reads_what_another_made_after_the_client_let_it_go():
    """The tensors a capture made are the graph's memory (as a CUDA graph's pool is): a second graph
    reading one still can after the client dropped it (make_graphed_callables' backward graph reads
    what the forward graph saved)."""
    x = torch.ones(2, device=DEV)
    first, second = ra.CUDAGraph(), ra.CUDAGraph()
    with ra.graph(first):
        made = x * 2
    with ra.graph(second):
        y = made + 1
    first.replay()
    del made
    second.replay()  # made is gone from the client, not from the first graph's memory
    assert torch.equal(y.cpu(), torch.full((2,), 3.0))
    x.fill_(5.0)
    first.replay()
    second.replay()
    second.replay()
    assert torch.equal(y.cpu(), torch.full((2,), 11.0))


def test_a_capture_computes_nothing_each_replay_once():
    """As on CUDA: capturing an in-place step does not take it; each replay takes it once."""
    counter = torch.zeros(1, device=DEV)
    g = ra.CUDAGraph()
    with ra.graph(g):
        counter.add_(1)
    assert torch.equal(counter.cpu(), torch.zeros(1))
    g.replay()
    g.replay()
    assert torch.equal(counter.cpu(), torch.full((1,), 2.0))


def test_a_failed_capture_keeps_what_the_stream_counts_as_sent():
    """A compiled function's first call inside a capture that then fails: its graph's definition
    still reaches the server, and later calls work."""
    f = torch.compile(lambda t: t * 2 + 1, backend="remote_accelerator", options={"compiler": "eager"})
    x = torch.arange(3.0).to(DEV)
    with pytest.raises(RuntimeError, match="not permitted while a graph is being captured"), ra.graph(ra.CUDAGraph()):
        f(x).sum().item()
    assert torch.equal(f(x).cpu(), torch.arange(3.0) * 2 + 1)


def test_a_graph_with_a_cpu_argument_leaves_nothing_behind_when_let_go():
    """A CPU tensor an op takes (uploaded with it) is the graph's for as long as the graph is; then
    nothing of the graph stays on the server."""
    x = torch.arange(3.0).to(DEV)
    torch.remote_accelerator.synchronize()
    before = ra.stats()["0"]["server_tensors"]
    g = ra.CUDAGraph()
    with ra.graph(g):
        y = x * torch.tensor(2.0)  # the 0-dim CPU tensor goes up with the op
    for scale in (1.0, 3.0):
        x.mul_(scale)
        g.replay()
        assert torch.equal(y.cpu(), x.cpu() * 2.0)
    del y, g
    torch.remote_accelerator.synchronize()
    assert ra.stats()["0"]["server_tensors"] == before


def test_a_capture_sends_nothing_before_its_end_when_batches_go_ahead():
    """With a server elsewhere, recorded ops go ahead in batches without waiting; a capture's may
    not: they are the graph, sent whole at its end."""
    from genie_core.remote_tensor.connection import stream_for

    stream = stream_for(0)
    was = stream.pipelined
    stream.pipelined, stream.SUBMIT_EVERY = True, 4
    try:
        x = torch.zeros(4, device=DEV)
        torch.remote_accelerator.synchronize()
        g = ra.CUDAGraph()
        messages = ra.stats()["0"]["messages"]
        with ra.graph(g):
            y = x
            for _ in range(20):
                y = y + 1
        assert ra.stats()["0"]["messages"] == messages
        g.replay()
        assert torch.equal(y.cpu(), torch.full((4,), 20.0))
    finally:
        stream.pipelined = was
        del stream.SUBMIT_EVERY


def test_a_graph_captured_after_its_signatures_were_verified_keeps_static_outputs():
    """Ops whose signatures a batch has verified are not checked again, but a capture's still
    carry what the server must find: a CPU capture makes each static output from it."""
    x = torch.arange(2.0).to(DEV)
    (x * 2).cpu()  # `x * 2` verified
    stream = x._stream
    assert any(s.verified == stream.trusted for s in stream.meta_cache.values() if s.op == "aten.mul.Tensor")
    g = ra.CUDAGraph()
    with ra.graph(g):
        y = x * 2
    g.replay()
    view = y.view(2)  # a view of the static output, as on CUDA
    x.fill_(5)
    g.replay()
    assert torch.equal(view.cpu(), torch.full((2,), 10.0)) and torch.equal(y.cpu(), torch.full((2,), 10.0))


def test_a_cell_during_a_capture_runs_after_what_was_recorded_before_the_capture(remote):
    import genie_core

    client = genie_core.get_cluster_state().client
    before = torch.randn(3, device=DEV)  # recorded before the capture: it draws before the cell seeds
    static = torch.zeros(3, device=DEV)
    g = ra.CUDAGraph()
    with ra.graph(g):
        out = static + 1
        assert client.execute("import torch; torch.manual_seed(7)").wait(30).content["status"] == "ok"
    after = torch.randn(3, device=DEV)
    g.replay()
    torch.manual_seed(7)
    assert torch.equal(after.cpu(), torch.randn(3)) and not torch.equal(before.cpu(), after.cpu())
    assert torch.equal(out.cpu(), torch.ones(3))
