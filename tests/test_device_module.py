"""What PyTorch's own code asks of a device beyond its ops: the device module
(`torch.remote_accelerator`), random-number state under checkpointing, pinned memory, the
recurrent layers, packed sequences and the transformer's nested inference path, each against the
CPU on a real server subprocess (a CPU server here).
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEV = "remote_accelerator:0"


# -- random numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_with_dropout_gives_the_cpus_gradients(remote, reentrant):
    """The recompute in backward must draw the same dropout mask as the forward did."""

    def grad(device):
        torch.manual_seed(0)
        x = torch.arange(1.0, 9.0).to(device).requires_grad_()
        checkpoint(lambda t: F.dropout(t, 0.5) * t, x, use_reentrant=reentrant).sum().backward()
        return x.grad.cpu()

    expected = grad("cpu")
    assert torch.equal(grad(DEV), expected), (grad(DEV), expected)


def test_a_checkpointed_model_trains_like_the_cpu(remote):
    """transformers' gradient_checkpointing_enable, in train mode with dropout: the gradients and
    one SGD step. (Not AdamW: its first step moves a parameter by the learning rate whatever the
    size of its gradient, so a gradient near 0 summed in another order, by a server with another
    number of threads, moved it the other way.)"""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=50)
    torch.manual_seed(0)
    local = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(local).to(DEV)
    ids = torch.randint(0, 50, (2, 12))
    for m, device in ((local, "cpu"), (model, DEV)):
        m.gradient_checkpointing_enable()
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        torch.manual_seed(7)
        m(ids.to(device), labels=ids.to(device)).loss.backward()
        opt.step()
    for (name, p), q in zip(local.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad.cpu(), p.grad, msg=f"gradient of {name}")
        torch.testing.assert_close(q.cpu(), p, msg=name)


RANDOM = {
    "rand": lambda d: torch.rand(5, device=d),
    "randn": lambda d: torch.randn(3, 4, device=d),
    "randint": lambda d: torch.randint(0, 100, (6,), device=d),
    "randperm": lambda d: torch.randperm(10, device=d),
    "dropout": lambda d: F.dropout(torch.ones(12, device=d), 0.5),
    "bernoulli": lambda d: torch.bernoulli(torch.full((8,), 0.3, device=d)),
    "multinomial": lambda d: torch.multinomial(torch.tensor([0.1, 0.2, 0.7], device=d), 6, replacement=True),
    "normal_": lambda d: torch.empty(5, device=d).normal_(2.0, 3.0),
    "uniform_": lambda d: torch.empty(5, device=d).uniform_(-1, 1),
    "exponential_": lambda d: torch.empty(5, device=d).exponential_(),
}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_random_ops_give_the_cpus_values_under_the_same_seed(remote, name):
    draw = RANDOM[name]
    torch.manual_seed(11)
    expected = draw("cpu")
    torch.manual_seed(11)
    assert torch.equal(draw(DEV).cpu(), expected)


def test_rng_state_and_fork_rng(remote):
    dev = torch.remote_accelerator
    torch.manual_seed(3)
    state = dev.get_rng_state()
    first = torch.randn(4, device=DEV).cpu()
    dev.set_rng_state(state)
    assert torch.equal(torch.randn(4, device=DEV).cpu(), first)
    with torch.random.fork_rng(device_type="remote_accelerator"):
        inside = torch.randn(4, device=DEV).cpu()
    assert torch.equal(torch.randn(4, device=DEV).cpu(), inside)  # the fork put the state back


# -- the device module --------------------------------------------------------------------------
def test_the_device_module_answers_from_the_server(remote):
    dev = torch.remote_accelerator
    assert dev._initialized and dev.is_initialized() and dev.is_available()
    props = dev.get_device_properties(0)
    assert props.name == dev.get_device_name() and "CPU" in props.name  # a CPU server's device 0 is its CPU
    assert dev.get_device_capability() == (0, 0) and props.total_memory > 2**30
    before = dev.memory_allocated()
    x = torch.empty(1 << 20, device=DEV)
    assert dev.memory_allocated() - before == 4 << 20  # 1 Mi float32, held by this session on the server
    del x
    assert dev.memory_allocated() == before
    free, total = dev.mem_get_info()
    assert 0 < free <= total
    assert f"hold {dev.memory_allocated():,} bytes" in dev.memory_summary()
    with pytest.raises(NotImplementedError, match="keeps no peak"):
        dev.max_memory_allocated()
    assert torch.accelerator.current_accelerator() == torch.device("remote_accelerator")


def test_an_answer_is_the_questions_whatever_is_recorded_after_it(remote, monkeypatch):
    """A question is named by its place in its batch: a remote tensor collected while the question
    is recorded (the garbage collector runs wherever Python allocates) records its free after it, in
    the same batch, and the answer is still the question's (seen on a GPU server: `load` after a big
    model was dropped answered None)."""
    from genie_core.remote_tensor.connection import stream_for

    held = [torch.ones(4, device=DEV)]
    held[0].cpu()
    stream = stream_for(0)

    class CollectedOnAppend(list):
        def append(self, record):
            super().append(record)
            if record[0] == "ask" and held:
                held.clear()  # its free is recorded here, after the question

        def __reduce__(self):  # (sent as the list it is)
            return list, (list(self),)

    monkeypatch.setattr(stream, "_records", CollectedOnAppend(stream._records))
    assert torch.remote_accelerator.mem_get_info()[1] > 0
    assert not held and stream.pending() == 0


def test_an_answer_is_waited_for_when_its_question_fills_a_pipelined_batch(remote, monkeypatch):
    """A stream that sends every few records without waiting (on a machine with cores to spare)
    still sends a question in the batch it waits for: a data-dependent op and a device question."""
    from genie_core.remote_tensor.connection import stream_for

    x = torch.tensor([0.0, 2.0, 0.0, 3.0], device=DEV)
    x.cpu()
    stream = stream_for(0)
    monkeypatch.setattr(stream, "pipelined", True)
    monkeypatch.setattr(stream, "SUBMIT_EVERY", 1)
    assert torch.nonzero(x).cpu().flatten().tolist() == [1, 3]
    assert torch.remote_accelerator.memory_allocated() > 0


def test_current_device_streams_and_events(remote):
    dev = torch.remote_accelerator
    with dev.device(0):
        assert dev.current_device() == 0 and torch.empty(1, device="remote_accelerator").device == torch.device(DEV)
    with pytest.raises(RuntimeError, match="remote_accelerator:3 does not exist"):
        dev.set_device(3)
    assert dev.current_device() == 0  # a refused set_device changes nothing
    start, end = dev.Event(enable_timing=True), dev.Event(enable_timing=True)
    a = torch.randn(300, 300, device=DEV)
    start.record()
    for _ in range(20):
        a = a @ a / 300
    end.record()
    end.synchronize()
    assert end.query() and 0 < start.elapsed_time(end) < 60_000
    stream = dev.current_stream()
    with dev.stream(stream):
        b = a + 1
    stream.synchronize()
    assert stream.query() and stream == dev.Stream(0)
    assert torch.equal(b.cpu(), a.cpu() + 1)


def test_torch_accelerator_is_answered_by_the_remote_device(remote):
    """torch.accelerator's calls into C++ (synchronize, the memory counters, the caches) go to
    torch.remote_accelerator while it is the current accelerator: they raised, failed an internal
    assert or crashed the process, and torch.utils.benchmark.Timer with them, even timing CPU code."""
    import torch.utils.benchmark as benchmark

    from genie_core.remote_tensor.connection import stream_for

    dev, stream = torch.remote_accelerator, stream_for(0)
    x = torch.ones(64, device=DEV)
    x.cpu()
    trips = stream.round_trips
    y = x + 1
    assert stream.pending() == 1
    torch.accelerator.synchronize()
    assert stream.pending() == 0 and stream.round_trips == trips + 1  # ran, and waited for
    before = torch.accelerator.memory_allocated()
    assert before == dev.memory_allocated()
    big = torch.empty(1 << 20, device=DEV)
    assert torch.accelerator.memory_allocated() - before == 4 << 20
    assert torch.accelerator.memory_stats()["allocated_bytes.all.current"] == before + (4 << 20)
    del big
    free, total = torch.accelerator.get_memory_info()
    assert 0 < free <= total and total == dev.mem_get_info()[1]
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    torch.accelerator.reset_accumulated_memory_stats()
    if hasattr(torch.accelerator, "empty_host_cache"):  # (torch 2.13 on)
        torch.accelerator.empty_host_cache()
    for where in (torch.ones(4), y):
        assert benchmark.Timer("x + 1", globals={"x": where}).timeit(3).mean > 0
    assert torch.equal(y.cpu(), torch.full((64,), 2.0))


def test_torch_accelerator_is_pytorchs_own_for_another_accelerator(remote, monkeypatch):
    """Only while remote_accelerator is the current accelerator: for another one (a client's own GPU)
    PyTorch's functions run as they are (here, where there is none, PyTorch's refusal shows it)."""
    monkeypatch.setattr(torch._C, "_accelerator_getAccelerator", lambda: torch.device("cuda"))
    with pytest.raises(RuntimeError, match="doesn't support synchronizing"):
        torch._C._accelerator_synchronizeDevice(0)


# -- pinned memory ------------------------------------------------------------------------------
def test_pin_memory_and_a_pinned_data_loader(remote):
    t = torch.randn(4, 3)[:, 1]
    pinned = t.pin_memory()
    assert pinned.is_pinned() and not t.is_pinned() and torch.equal(pinned, t)
    assert torch.equal(pinned.to(DEV, non_blocking=True).cpu(), t)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(16.0).view(8, 2)), batch_size=4, pin_memory=True
    )
    batches = [b for (b,) in loader]
    assert all(b.is_pinned() for b in batches) and torch.equal(torch.cat(batches), torch.arange(16.0).view(8, 2))
    on_device = torch.ones(2, device=DEV)
    with pytest.raises(RuntimeError, match="cannot pin a remote_accelerator tensor"):  # at the op, as CUDA's
        on_device.pin_memory()
    assert not on_device.is_pinned() and torch.equal(on_device.cpu(), torch.ones(2))


class _ScaledByIndex(torch.utils.data.Dataset):
    """Items read from a remote tensor: in a forked DataLoader worker, refused (as CUDA is there)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        assert torch.remote_accelerator._is_in_bad_fork()
        return (self.values * i).cpu()


def test_a_forked_worker_is_refused_at_once_and_the_session_goes_on(remote):
    """A fork's sockets are its parent's, without their I/O threads (using them would hang until the
    DataLoader's timeout, forever without one): one clear error, the parent's session and tensors
    intact."""
    values = torch.arange(4.0, device=DEV)
    loader = torch.utils.data.DataLoader(
        _ScaledByIndex(values), batch_size=2, num_workers=1, multiprocessing_context="fork", timeout=20
    )
    with pytest.raises(RuntimeError, match="Cannot use remote_accelerator tensors in a forked subprocess"):
        list(loader)
    assert not torch.remote_accelerator._is_in_bad_fork()
    assert torch.equal((values + 1).cpu(), torch.arange(1.0, 5.0))


def test_a_refused_memory_lock_says_so(remote, tmp_path):
    """A process without the capability to lock memory past `ulimit -l` (root has it; here it is
    dropped, and the limit set to 8 MiB) pinning more than that gets one clear error, never
    pageable memory that claims to be pinned. (The same user, so the checkout stays readable.)"""
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))\n"
        "import torch, genie_core.remote_tensor.device as d; d.register()\n"
        "print(torch.randn(4).pin_memory().is_pinned())\n"
        "try:\n    torch.randn(1 << 22).pin_memory()\nexcept RuntimeError as e:\n    print(e)\n"
    )
    run = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1]),
        },
    )
    if run.returncode and "Operation not permitted" in run.stderr:
        pytest.skip("setpriv cannot drop capabilities here")
    lines = run.stdout.splitlines()
    assert lines[:1] == ["True"], run.stderr[-2000:]
    assert "cannot pin 16.0 MiB of host memory" in lines[1] and "ulimit -l" in lines[1], lines


# -- recurrent layers and packed sequences -------------------------------------------------------
RECURRENT = {
    "lstm-2-layer-bidirectional-dropout": (
        lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True, dropout=0.3),
        (5, 2, 3),
    ),
    "gru-batch-first": (lambda: nn.GRU(3, 4, batch_first=True), (2, 5, 3)),
    "rnn-relu": (lambda: nn.RNN(3, 4, nonlinearity="relu"), (5, 2, 3)),
    "lstm-cell": (lambda: nn.LSTMCell(3, 4), (2, 3)),
    "gru-cell": (lambda: nn.GRUCell(3, 4), (2, 3)),
    "rnn-cell": (lambda: nn.RNNCell(3, 4), (2, 3)),
}


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_recurrent_layers_train_like_the_cpu(remote, name):
    make, shape = RECURRENT[name]
    torch.manual_seed(0)
    local = make().train()
    model = copy.deepcopy(local).to(DEV)
    x = torch.randn(*shape)
    grads = []
    for m, device in ((local, "cpu"), (model, DEV)):
        inp = x.clone().to(device).requires_grad_()
        torch.manual_seed(1)
        outs = _flat(m(inp))
        torch.manual_seed(2)
        loss = sum((o * torch.randn(o.shape).to(device)).sum() for o in outs)
        grads.append([g.cpu() for g in torch.autograd.grad(loss, [inp, *m.parameters()])])
        grads[-1].append([o.detach().cpu() for o in outs])
    torch.testing.assert_close(grads[1], grads[0])


def test_packed_sequences_through_an_lstm(remote):
    torch.manual_seed(0)
    local = nn.LSTM(3, 4)
    model = copy.deepcopy(local).to(DEV)
    x = torch.randn(5, 3, 3)
    lengths = torch.tensor([3, 5, 2])  # unsorted: pack sorts and unsorts on the device
    results = []
    for m, device in ((local, "cpu"), (model, DEV)):
        inp = x.clone().to(device).requires_grad_()
        packed = nn.utils.rnn.pack_padded_sequence(inp, lengths, enforce_sorted=False)
        assert packed.batch_sizes.device.type == "cpu"  # as PyTorch keeps them, on any device
        out, (h, _) = m(packed)
        padded, out_lengths = nn.utils.rnn.pad_packed_sequence(out)
        (padded.sum() + h.sum()).backward()
        results.append(
            [padded.detach().cpu(), out_lengths, h.detach().cpu(), inp.grad.cpu(), m.weight_hh_l0.grad.cpu()]
        )
    torch.testing.assert_close(results[1], results[0])


def test_the_transformer_encoders_nested_inference_path(remote):
    """Eval mode, no grad, a padding mask: PyTorch's fast path packs the batch into a nested
    tensor (kept on the server) and pads the output with zeros, as on the CPU."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    local = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    model = copy.deepcopy(local).to(DEV)
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        expected = local(x, src_key_padding_mask=mask)
        actual = model(x.to(DEV), src_key_padding_mask=mask.to(DEV)).cpu()
    assert torch.equal(expected[1, 3:], torch.zeros(2, 8))  # the nested path ran (the padded rows are zeros)
    torch.testing.assert_close(actual, expected)


def test_a_lazy_module_moved_before_its_first_forward(remote):
    torch.manual_seed(0)
    local = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    model = copy.deepcopy(local).to(DEV)
    assert isinstance(model[0].weight, nn.UninitializedParameter) and model[0].weight.device == torch.device(DEV)
    x = torch.randn(3, 5)
    torch.manual_seed(1)
    expected = local(x)
    torch.manual_seed(1)
    actual = model(x.to(DEV))
    assert type(model[0]) is nn.Linear and model[0].weight.shape == (4, 5)
    assert torch.equal(actual.cpu(), expected)


# -- the audit ----------------------------------------------------------------------------------
# What PyTorch's device-generic Python code (torch.utils.checkpoint, torch.random.fork_rng,
# torch.amp, torch.utils.data, torch.distributed, torch._utils._get_device_module users) and the
# usual torch.cuda utilities ask a device module for: None where torch.remote_accelerator has it,
# else why not.
AUDIT = {
    "is_available": None,
    "device_count": None,
    "is_initialized": None,
    "_initialized": None,
    "init": None,
    "_lazy_init": None,
    "_is_in_bad_fork": None,
    "current_device": None,
    "set_device": None,
    "device": None,
    "device_of": None,
    "synchronize": None,
    "manual_seed": None,
    "manual_seed_all": None,
    "seed": None,
    "seed_all": None,
    "initial_seed": None,
    "get_rng_state": None,
    "set_rng_state": None,
    "get_rng_state_all": None,
    "set_rng_state_all": None,
    "Stream": None,
    "Event": None,
    "current_stream": None,
    "default_stream": None,
    "set_stream": None,
    "stream": None,
    "get_amp_supported_dtype": None,
    "is_bf16_supported": None,
    "get_device_name": None,
    "get_device_properties": None,
    "get_device_capability": None,
    "memory_stats": None,
    "memory_allocated": None,
    "max_memory_allocated": None,
    "memory_reserved": None,
    "max_memory_reserved": None,
    "reset_peak_memory_stats": None,
    "reset_accumulated_memory_stats": None,
    "mem_get_info": None,
    "empty_cache": None,
    "default_generators": "explicit torch.Generator objects: the generator is the server device's own",
    "_get_generator": "explicit torch.Generator objects: the generator is the server device's own",
    "set_rng_ctx": "DTensor's random state across ranks (torch.distributed.tensor): not for one remote device",
    "unset_rng_ctx": "DTensor's random state across ranks (torch.distributed.tensor): not for one remote device",
    "memory_summary": None,
    "CUDAGraph": None,
    "graph": None,
    "make_graphed_callables": None,
    "graph_pool_handle": None,
    "is_current_stream_capturing": None,
    "ipc_collect": "CUDA IPC between processes: the server's tensors never leave its worker",
}

# Beyond the module: what PyTorch reaches in C++ for a device, where a device defined in Python
# (torch.utils.backend_registration) cannot answer.
REFUSED_IN_CPP = {
    "torch.Stream(...).synchronize(), torch.Event(...) (PyTorch's generic ones)": "PyTorch's Python device "
    "guard answers their synchronize, query and record without waiting: use torch.remote_accelerator.Stream "
    "and Event, or torch.accelerator.synchronize() (answered by the remote device, as its memory calls are)",
    "torch.accelerator.get_device_capability(), torch.accelerator.Graph": "asks the C++ device guard, which a "
    "device defined in Python lacks (PyTorch's error says so)",
    "torch.Generator(device=...)": "asks the C++ hooks for a generator: the device's own generator is seeded "
    "with torch.manual_seed, and its state is get_rng_state()",
    "torch.empty(..., pin_memory=True)": "asks the C++ hooks for a pinned allocator: use .pin_memory(), which works",
    "max_memory_allocated() on a CPU server": "the CPU keeps no peak (memory_allocated() is exact); "
    "a GPU server answers (torch.accelerator.max_memory_allocated() reads a peak not kept as 0, as PyTorch "
    "does for any backend without one)",
}


def test_the_device_module_audit(remote):
    from opinfo_conformance import write_section

    dev = torch.remote_accelerator
    found = {name: hasattr(dev, name) for name in AUDIT}
    assert found == {name: why is None for name, why in AUDIT.items()}
    lines = [
        "## The device module (`torch.remote_accelerator`)",
        "",
        "Checked by `tests/test_device_module.py` (`test_the_device_module_audit`): what PyTorch's "
        "device-generic code and the usual `torch.cuda` utilities ask a device module for. Answers about "
        "the device (properties, memory) come from the server, one round trip each; RNG seeds and states "
        "are recorded with the ops; on a CPU server every random op gives the CPU's values under the same "
        "seed (a GPU server draws from its own generator: seeded alike, its values are CUDA's, not the "
        "CPU's).",
        "",
        "| | |",
        "| --- | --- |",
        f"| there | {', '.join(f'`{n}`' for n, why in AUDIT.items() if why is None)} |",
    ]
    lines += [f"| refused: `{n}` | {why} |" for n, why in AUDIT.items() if why is not None]
    lines += [f"| refused: `{n}` | {why} |" for n, why in REFUSED_IN_CPP.items()]
    write_section("device-module", "\n".join(lines))
