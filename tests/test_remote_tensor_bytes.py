"""A remote tensor's bytes take the data plane the session chose (shared memory on one host, tcp
across hosts), both ways, in order with the op stream: uploads (`.to()`, `copy_`, `torch.tensor`,
`model.to`, `load_state_dict`, `torch.load(map_location=...)`) and fetches (`.cpu()`, `.numpy()`,
`state_dict()` to the CPU). Small tensors stay inline."""

from __future__ import annotations

import io
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from conftest import session_on, start_server

import genie_core
from genie_core.dataplane import lent as lent_module
from genie_core.dataplane.lent import LentMaps, LentSegments
from genie_core.dataplane.segment import SHM_DIR, Segment
from genie_core.dataplane.shm import ShmChannel
from genie_core.errors import RemoteError
from genie_core.protocol.contents import DataRef
from genie_core.remote_tensor.connection import stream_for
from genie_core.remote_tensor.stream import OpStream, lends_uploads

DEV = "remote_accelerator:0"
MiB = 1 << 20


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A session on shared memory, named rather than discovered: discovery's choice on a loaded
    machine is its own test's business (test_transport), the path of a tensor's bytes is this one's."""
    with session_on(start_server(tmp_path_factory.mktemp("bytes"), "--gpus", ""), backend="shm") as srv:
        yield srv


@pytest.fixture
def moved(remote):
    """What the session's data channel carried: the sizes put and the number of gets."""
    channel = genie_core.get_cluster_state().client.transfers.channel
    assert channel.name == "shm"
    seen: dict[str, list[int]] = {"put": [], "get": []}
    put, get = channel.put, channel.get

    def counting_put(buffers, progress=None):
        seen["put"].append(sum(memoryview(b).nbytes for b in buffers))
        return put(buffers, progress)

    def counting_get(ref, progress=None):
        seen["get"].append(sum(int(n) for n in ref["sizes"]))
        return get(ref, progress)

    channel.put, channel.get = counting_put, counting_get
    yield seen
    del channel.put, channel.get


def test_big_tensors_go_by_the_data_plane_both_ways_and_small_ones_inline(moved):
    x = torch.randn(2 * MiB)  # 8 MiB
    y = x.to(DEV)
    assert moved["put"] == [8 * MiB]  # sent at the end of the op, not at the next value
    assert torch.equal(y.cpu(), x) and moved["get"] == [8 * MiB]
    assert torch.equal(torch.from_numpy((y * 2).numpy()), x * 2) and len(moved["get"]) == 2
    small = torch.arange(10.0)
    assert torch.equal(small.to(DEV).cpu(), small)
    assert len(moved["put"]) == 1 and len(moved["get"]) == 2


def test_an_upload_is_the_values_at_the_time_of_the_call(moved):
    """The bytes are read from the tensor's own memory as they are sent, before the call returns:
    what the user changes afterwards never reaches the server."""
    x = torch.zeros(MiB)
    y = x.to(DEV)
    x.fill_(1.0)
    into = torch.empty(MiB, device=DEV)
    into.copy_(x)
    x.fill_(2.0)
    made = torch.tensor(x, device=DEV)
    x.fill_(3.0)
    assert y.sum().item() == 0 and into.sum().item() == MiB and made.sum().item() == 2 * MiB
    view = torch.arange(4.0 * MiB).view(MiB, 4)[:, 1]  # not dense: copied here, then sent
    assert torch.equal(view.to(DEV).cpu(), view)
    assert len(moved["put"]) == 4


def test_a_fetch_is_the_cpu_tensor_that_was_asked_for(moved):
    """`.cpu()` hands over the fetched memory only where it is already what was asked: another
    dtype, memory format or layout of strides is made from it as a CPU tensor would be."""
    x = torch.randn(4, 64, 32, 32)  # 1 MiB
    y = x.to(DEV)
    cases = {
        "cpu()": (y.cpu(), x.cpu()),
        "float64": (y.to("cpu", dtype=torch.float64), x.to("cpu", dtype=torch.float64)),
        "channels_last": (y.to("cpu", memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)),
    }
    for name, (got, want) in cases.items():
        assert (got.dtype, got.stride()) == (want.dtype, want.stride()), name
        assert torch.equal(got, want), name
    # (a transposed remote tensor comes back dense in its new order, where CUDA keeps the strides)
    assert torch.equal(y.transpose(1, 3).cpu(), x.transpose(1, 3))


def test_a_copy_into_a_tensor_something_has_seen_writes_into_its_memory(moved):
    """An upload becomes its destination's storage only where nothing can have seen that storage
    (an empty tensor made by the op just before); a view of it must see the copied values."""
    x = torch.randn(MiB)
    filled = torch.zeros(MiB, device=DEV)
    tail = filled[1:]
    filled.copy_(x)
    empty = torch.empty(MiB, device=DEV)
    head = empty[:10]
    empty.copy_(x)
    assert torch.equal(tail.cpu(), x[1:]) and torch.equal(head.cpu(), x[:10])
    assert torch.equal(filled.cpu(), x) and torch.equal(empty.cpu(), x)


def test_models_and_checkpoints_move_by_the_data_plane(moved):
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1024))  # 4 MiB of weights
    model = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1024)).to(DEV)
    model.load_state_dict(local.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), local.state_dict()[name]), name
    buffer = io.BytesIO()
    torch.save(local.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location=DEV)
    assert all(v.device == torch.device(DEV) for v in loaded.values())
    inp = torch.randn(8, 1024)
    twin = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1024)).to(DEV)
    twin.load_state_dict(loaded)
    assert torch.equal(twin(inp.to(DEV)).cpu(), local(inp))
    assert sum(moved["put"]) >= 2 * 4 * MiB and moved["get"]


@pytest.fixture
def lent(remote, monkeypatch):
    """Uploads in lent segments, as a GPU server has them (a CPU server's worker then keeps copies)."""
    monkeypatch.setenv("GENIE_UPLOAD_SEGMENTS", "lent")
    return genie_core.get_cluster_state().client.transfers.channel.lent_segments(0)


def _lent_refs(lent: LentSegments, monkeypatch) -> list[DataRef]:
    """The references of the lent regions filled from here on, as they are made."""
    refs: list[DataRef] = []
    monkeypatch.setattr(lent, "ref", lambda region, sizes, ref=lent.ref: refs.append(ref(region, sizes)) or refs[-1])
    return refs


def _a_model_moves_and_computes() -> None:
    model = nn.Linear(1024, 1024)
    remote = nn.Linear(1024, 1024).to(DEV)
    remote.load_state_dict(model.state_dict())
    inp = torch.randn(4, 1024)
    assert torch.allclose(remote(inp.to(DEV)).cpu(), model(inp), atol=1e-5)


def test_a_lent_region_is_filled_again_only_once_its_batch_is_answered(lent, monkeypatch, tmp_path):
    """Uploads sent while the worker is busy each take a region of their own in one segment; once
    answered, the next ones fill the segment again from its start (the pages already warm), and no
    name is left in /dev/shm."""
    client = genie_core.get_cluster_state().client
    refs = _lent_refs(lent, monkeypatch)
    made = lent.made
    x = torch.randn(MiB)  # 4 MiB
    gate = tmp_path / "go"
    busy = client.execute(  # the worker runs nothing else until the uploads are sent (at most 30 s)
        f"import os, time\nfor _ in range(3000):\n    if os.path.exists({str(gate)!r}): break\n    time.sleep(0.01)"
    )
    queued = [(x + i).to(DEV) for i in range(3)]
    gate.touch()
    assert len({(r["segment"], r["offset"]) for r in refs}) == 3 and len({r["segment"] for r in refs}) == 1
    for i, y in enumerate(queued):
        assert torch.equal(y.cpu(), x + i), i
    busy.wait(30)
    for i in range(3, 6):
        assert torch.equal((x + i).to(DEV).cpu(), x + i), i
    assert lent.made - made <= 1 and [r["offset"] for r in refs[3:]] == [0, 0, 0]
    assert not (SHM_DIR / refs[0]["segment"]).exists()
    _a_model_moves_and_computes()


def test_a_big_upload_to_a_worker_that_copies_it_out_goes_in_parts(lent, monkeypatch):
    """Past UPLOAD_PART bytes an upload to a GPU server goes in parts, a batch each, sent before
    the op returns (a later change to the CPU tensor does not reach it): every byte arrives, in any
    dtype and layout, and each part takes a region of its own size, not a segment of the tensor's."""
    monkeypatch.setattr(OpStream, "UPLOAD_PART", MiB)
    refs = _lent_refs(lent, monkeypatch)
    for x in (
        torch.randn(1000, 1500).to(torch.bfloat16),  # 2.9 MiB: three parts
        torch.randn(1500, 1000).t(),  # not contiguous: one copy here, then 6 parts
        torch.arange(3 * MiB // 8, dtype=torch.float64),  # exactly 3 parts
        torch.arange(MiB // 4 + 16),  # 64 bytes over a part: two of half that, both by the data plane
    ):
        refs.clear()
        y = x.to(DEV)
        before = x.clone()
        x.add_(1)
        assert torch.equal(y.cpu(), before) and y.stride() == before.stride()
        assert len(refs) == -(-x.nbytes // MiB) and max(sum(r["sizes"]) for r in refs) <= MiB
    _a_model_moves_and_computes()


def test_an_upload_interrupted_between_parts_leaves_nothing_on_the_worker(lent, monkeypatch):
    """Ctrl-C between two parts of an upload: what parts went are let go on the worker with the
    next batch, and the session goes on."""
    monkeypatch.setattr(OpStream, "UPLOAD_PART", MiB)
    stream = stream_for(0)
    torch.remote_accelerator.synchronize()
    held = stream.server_tensors
    submit, calls = OpStream._submit, []

    def interrupted(self, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        submit(self, **kwargs)

    monkeypatch.setattr(OpStream, "_submit", interrupted)
    x = torch.arange(float(MiB))  # 4 MiB: 4 parts
    with pytest.raises(KeyboardInterrupt):
        x.to(DEV)
    monkeypatch.setattr(OpStream, "_submit", submit)
    torch.remote_accelerator.synchronize()
    assert stream.server_tensors == held
    assert torch.equal(x.to(DEV).cpu(), x)


def _request(answer: dict | None = None) -> SimpleNamespace:
    """A request as a lent region sees it (client/connection.py: Request)."""
    settled = threading.Event()
    if answer is not None:
        settled.set()
    return SimpleNamespace(answer=answer, lost=False, settled=settled)


def _answer(request: SimpleNamespace, **answer) -> None:
    request.answer = {"status": "ok", **answer}
    request.settled.set()


def _lend(pool: LentSegments, size: int, request: SimpleNamespace) -> DataRef | None:
    region = pool.take(size)
    if region is None:
        return None
    ref = pool.ref(region, [size])
    pool.lend(ref, request)
    return ref


def test_each_worker_is_lent_segments_of_its_own():
    """A server of several GPUs runs a worker for each, and each removes the names of the segments
    it maps: a segment lent to one is never filled for another, even once answered."""
    channel = ShmChannel()
    try:
        names = []
        for worker in (0, 1, 0, 1):
            ref = channel.put_lent([bytes(MiB)], worker)
            channel.lent_to(ref, _request({"status": "ok"}))
            names.append((worker, ref["segment"]))
        assert names[0][1] == names[2][1] and names[1][1] == names[3][1] and names[0][1] != names[1][1]
    finally:
        channel.close()


def test_lent_segments_stay_within_their_limit(monkeypatch):
    """Past the limit a free segment makes room, one with a region out on loan never does: then the
    caller gets None (and sends a one-off segment)."""
    monkeypatch.setattr(lent_module, "WAIT", 0.1)  # (the last take waits for the second's answer first)
    pool = LentSegments(limit=2 * MiB)
    try:
        first = _lend(pool, MiB, _request({"status": "ok"}))
        second = _lend(pool, 2 * MiB, _request())  # the free first one is retired to make room
        assert first and second and pool.made == 2 and not (SHM_DIR / first["segment"]).exists()
        assert pool.take(MiB) is None and pool.made == 2  # all out on loan: nothing retired for it
    finally:
        pool.close()


def test_an_upload_past_the_working_bytes_waits_for_the_worker_once_not_for_a_busy_one(monkeypatch):
    """Once WORKING_BYTES are made, an upload with no room waits for the oldest batch's answer and
    takes the region it frees; one the worker does not answer within WAIT is not waited for again
    (a busy worker: a new segment instead)."""
    monkeypatch.setattr(lent_module, "MIN_SIZE", 4 * MiB)
    monkeypatch.setattr(lent_module, "WORKING_BYTES", 4 * MiB)
    monkeypatch.setattr(lent_module, "WAIT", 30)  # (answered after 0.1 s)
    pool = LentSegments(limit=64 * MiB)
    try:
        oldest, newer = _request(), _request()
        first = _lend(pool, 2 * MiB, oldest)
        _lend(pool, 2 * MiB, newer)
        threading.Timer(0.1, _answer, (oldest,)).start()
        third = _lend(pool, 2 * MiB, _request())
        assert third == {**first, "sizes": [2 * MiB]} and pool.made == 1 and pool.waits == 1
        monkeypatch.setattr(lent_module, "WAIT", 0.3)
        start = time.monotonic()
        fourth = _lend(pool, 4 * MiB, _request())  # `newer` is never answered: WAIT, then a new segment
        fifth = _lend(pool, 2 * MiB, _request())  # no room again, and `newer` not waited for again
        assert fourth and fifth and len({first["segment"], fourth["segment"], fifth["segment"]}) == 3
        assert pool.made == 3 and pool.waits == 2 and time.monotonic() - start >= 0.3
    finally:
        pool.close()


def test_a_region_whose_batch_did_not_go_is_free_again_and_its_segment_kept(monkeypatch):
    """A region whose filling failed (its batch certainly not sent) is taken again at once, and its
    warm segment is not retired for it."""
    pool = LentSegments(limit=256 * MiB)
    try:
        region = pool.take(MiB)
        ref = pool.ref(region, [])
        pool.forget(ref, sent=False)
        again = _lend(pool, MiB, _request())
        assert again and again["segment"] == ref["segment"] and again["offset"] == ref["offset"] == 0
        assert pool.made == 1 and (SHM_DIR / ref["segment"]).exists()
    finally:
        pool.close()


def test_a_region_whose_batch_may_have_gone_retires_its_segment():
    """A region whose sending failed (the worker may or may not map its segment) spoils it: the
    segment is unlinked, its name goes to the worker with the next lent reference, and the next
    upload takes a new one."""
    pool = LentSegments(limit=256 * MiB)
    try:
        region = pool.take(MiB)
        ref = pool.ref(region, [MiB])
        pool.forget(ref)
        after = _lend(pool, MiB, _request())
        assert after and after["segment"] != ref["segment"] and after["retired"] == [ref["segment"]]
        assert pool.made == 2 and not (SHM_DIR / ref["segment"]).exists()
    finally:
        pool.close()


def test_a_segment_a_batch_kept_a_view_of_is_retired_once_nothing_in_it_is_out():
    """An answer that says `kept` (or an error) spoils the region's segment: nothing more is placed
    in it, and it is retired (unlinked, its name sent for the worker to unmap) only once every
    other region of it out is answered, since a batch still in flight may be the worker's first to
    map it."""
    pool = LentSegments(limit=256 * MiB)
    try:
        kept, in_flight = _request(), _request()
        first = _lend(pool, MiB, kept)
        _lend(pool, MiB, in_flight)
        _answer(kept, kept=True)
        elsewhere = _lend(pool, MiB, _request())
        assert first and elsewhere and elsewhere["segment"] != first["segment"]
        assert (SHM_DIR / first["segment"]).exists() and "retired" not in elsewhere
        _answer(in_flight)
        after = _lend(pool, MiB, _request())
        assert after and after["retired"] == [first["segment"]] and not (SHM_DIR / first["segment"]).exists()
    finally:
        pool.close()


def test_a_workers_lent_mapping_goes_when_its_client_retires_it():
    """The worker side of lent segments: mapped once (the name removed at once); a batch's buffers
    start at its region's offset, and one past the segment's end is refused; a batch that left a
    view of its buffers behind says so (the client retires the segment), one that did not does not;
    a retired name is unmapped, and so is every one of a client that another replaced."""
    kept_one, reused, retired = (Segment.create("genie-c", MiB) for _ in range(3))
    maps = LentMaps()
    try:
        kept_one.view[4096:4100] = b"abcd"
        buffers, kept = maps.buffers(DataRef(segment=kept_one.name, sizes=[4, 100], lent=True, offset=4096))
        assert bytes(buffers[0]) == b"abcd" and not (SHM_DIR / kept_one.name).exists()
        held = torch.frombuffer(buffers[0], dtype=torch.uint8)
        del buffers
        assert kept() and kept_one.name in maps._maps  # (other batches may name other regions of it)
        with pytest.raises(ValueError, match="past the end"):
            maps.buffers(DataRef(segment=kept_one.name, sizes=[MiB], lent=True, offset=4096))
        for n in range(2):
            reused.view[:1] = bytes([n])
            buffers, kept = maps.buffers(DataRef(segment=reused.name, sizes=[1], lent=True))
            copied = torch.frombuffer(buffers[0], dtype=torch.uint8).clone()
            del buffers
            assert not kept() and copied.item() == n
        maps.buffers(DataRef(segment=retired.name, sizes=[1], lent=True, retired=[reused.name, kept_one.name]))
        assert reused.name not in maps._maps and kept_one.name not in maps._maps and retired.name in maps._maps
        assert bytes(held.numpy()) == b"abcd"  # (its memory goes with the view)
        with pytest.raises(FileNotFoundError):  # another client (one that reattached) names its own
            maps.buffers(DataRef(segment=kept_one.name, sizes=[1], lent=True, lender="another"))
        assert not maps._maps  # the last client's mappings went with it
    finally:
        maps.close()
        for segment in (kept_one, reused, retired):
            segment.close()
            segment.unlink()


def test_the_upload_segments_way_is_refused_when_mistyped(monkeypatch):
    assert lends_uploads("cuda") and not lends_uploads("cpu")
    monkeypatch.setenv("GENIE_UPLOAD_SEGMENTS", "lend")
    with pytest.raises(ValueError, match="GENIE_UPLOAD_SEGMENTS='lend': expected one of lent, adopted"):
        lends_uploads("cuda")


def _server(code: str) -> None:
    reply = genie_core.get_cluster_state().client.execute(code).wait(120).content
    assert reply["status"] == "ok", reply


@pytest.fixture
def uploads(remote):
    """The tensors this client uploads, by size (any size: inline ones too)."""
    from genie_core.remote_tensor.connection import stream_for

    stream = stream_for(0)
    sizes: list[int] = []
    upload = stream.upload

    def counting(rid, tensor):
        sizes.append(tensor.numel() * tensor.element_size())
        return upload(rid, tensor)

    stream.upload = counting
    yield sizes
    del stream.upload


def _server_folder() -> str:
    """A fresh folder on the server (its own /tmp: a sandboxed worker sees no other)."""
    _server("import tempfile\n_genie_folder = tempfile.mkdtemp()")
    return genie_core.get_cluster_state().client.pull(["_genie_folder"])["_genie_folder"]


def test_a_checkpoint_on_the_servers_disk_loads_there(uploads):
    """torch.save and safetensors files a remote cell wrote load onto the device with no byte of them
    through the client; their structure comes back whole."""
    tmp_path = _server_folder()
    _server(f"""
import torch, torch.nn as nn
from safetensors.torch import save_file
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1024))
state = m.state_dict()
torch.save({{"model": state, "step": 3, "betas": (0.9, 0.99)}}, "{tmp_path}/ckpt.pt")
save_file(state, "{tmp_path}/ckpt.safetensors")
""")
    expected = genie_core.get_cluster_state().client.pull(["state"])["state"]
    ckpt = torch.remote_accelerator.load(f"{tmp_path}/ckpt.pt")
    assert ckpt["step"] == 3 and ckpt["betas"] == (0.9, 0.99)
    flat = torch.remote_accelerator.load(f"{tmp_path}/ckpt.safetensors")
    assert uploads == []  # nothing went up
    for name, value in expected.items():
        for got in (ckpt["model"][name], flat[name]):
            assert got.device == torch.device(DEV) and torch.equal(got.cpu(), value), name
    model = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1024)).to(DEV)
    model.load_state_dict(flat)
    with pytest.raises(RemoteError, match=r"FileNotFoundError: .*no checkpoint at .*missing\.pt on the server"):
        torch.remote_accelerator.load(f"{tmp_path}/missing.pt")
    assert torch.equal(model[0].weight.cpu(), expected["0.weight"])  # the session goes on


@pytest.mark.parametrize("auto", [False, True], ids=["GPT2LMHeadModel", "AutoModelForCausalLM"])
def test_from_pretrained_of_a_model_directory_on_the_server(uploads, auto):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    tmp_path = _server_folder()
    _server(f"""
import torch, transformers
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=4096)
saved = transformers.GPT2LMHeadModel(config)
saved.save_pretrained("{tmp_path}/gpt2")
state = saved.state_dict()
""")
    local = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=4096)
    )
    local.load_state_dict(genie_core.get_cluster_state().client.pull(["state"])["state"])
    local.eval()
    kind = transformers.AutoModelForCausalLM if auto else transformers.GPT2LMHeadModel
    model = torch.remote_accelerator.from_pretrained(kind, f"{tmp_path}/gpt2")
    assert type(model) is transformers.GPT2LMHeadModel and not model.training
    assert max(uploads, default=0) < 1024, "the weights went up from here"  # (a few small ones made here)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as transformers ties them
    ids = torch.randint(0, 4096, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids.to(DEV)).logits.cpu(), local(ids).logits)


def test_the_workers_host_copies_leave_a_cpu_server_alone_and_refuse_an_unknown_way(monkeypatch):
    """worker/host_copies.py on a CPU server: the copy PyTorch makes (GENIE_HOST_COPIES not even read),
    a mistyped way refused in one line wherever it is read, and which layouts cover their storage
    once (those the GPU ways copy byte for byte)."""
    from genie_core.worker import host_copies

    monkeypatch.setenv("GENIE_HOST_COPIES", "rng")
    x = torch.randn(2 * MiB)
    assert torch.equal(host_copies.to_device(x, torch.device("cpu")), x)
    meta, (data,) = host_copies.serialized(x)  # copied from the tensor's memory where it is sent
    assert meta["shape"] == [2 * MiB] and torch.equal(torch.frombuffer(data.host(), dtype=torch.float32), x)
    x.resize_(4 * MiB)  # (a NumPy view of its memory, which a fetch sent before, made it unresizable for good)
    with pytest.raises(ValueError, match="GENIE_HOST_COPIES='rng': expected one of ring, register, pageable"):
        host_copies.way()
    base = torch.randn(4)
    dense = [torch.randn(3, 4).t(), torch.randn(4, 1, 3), torch.randn(0), torch.tensor(1.0)]
    not_dense = [torch.as_strided(base, (2, 2), (1, 1)), torch.randn(5)[1:], torch.randn(2, 3)[:, :2]]
    assert all(map(host_copies._dense, dense)) and not any(map(host_copies._dense, not_dense))


def test_packing_copies_every_byte_and_warns_of_nothing():
    """pack_into: big buffers on memcopy's threads (read-only ones too), small ones by memoryview,
    without a warning from torch about a buffer it could write."""
    import warnings

    import numpy as np

    from genie_core.dataplane.segment import Segment, pack_into
    from genie_core.protocol.tensor_ops import torch_bytes

    big, read_only, small = torch.randn(MiB), bytes(range(256)) * 8192, np.arange(100, dtype=np.uint8)
    segment = Segment.create("genie-test", 8 * MiB)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sizes = pack_into(segment.view, [torch_bytes(big), read_only, small])
        got = np.frombuffer(segment.view, dtype=np.uint8)
        a, b = sizes[0], sizes[0] + sizes[1]
        assert (got[:a] == torch_bytes(big)).all() and got[a:b].tobytes() == read_only
        assert (got[b : b + sizes[2]] == small).all()
        del got
    finally:
        segment.close()
        segment.unlink()


def test_big_copies_go_in_pieces_on_the_copy_threads_and_land_whole(monkeypatch):
    """memcopy: a copy past PIECE is cut into pieces (page-aligned starts, a short last one), each
    but the caller's on a thread of the pool; every byte lands, whatever the size."""
    import numpy as np

    from genie_core.dataplane import memcopy

    monkeypatch.setattr(memcopy, "THREADS", 4)  # (a pool even on a 2-core machine)
    names: set[str] = set()
    pieces: list[tuple[int, int]] = []
    move = memcopy._move

    def noted(dst, src, n):
        names.add(threading.current_thread().name.split("_")[0])
        pieces.append((dst, n))
        return move(dst, src, n)

    monkeypatch.setattr(memcopy, "_move", noted)
    rng = np.random.default_rng(0)
    for n in (0, 1, MiB - 1, 3 * MiB + 7, 9 * MiB + 4097):
        src = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        dst = bytearray(n)
        pieces.clear()
        memcopy.copy_buffer(memoryview(dst), src)  # (a read-only source)
        assert bytes(dst) == src, n
        base = min(at for at, _ in pieces)
        starts = sorted((at - base, size) for at, size in pieces)
        assert len(starts) == (1 if n < 2 * MiB else min(4, n // MiB)), (n, starts)
        assert all(start % 4096 == 0 for start, _ in starts), starts  # (pages of the buffer)
        assert [start for start, _ in starts] == [0, *(start + size for start, size in starts[:-1])]
        assert sum(size for _, size in starts) == n
    assert names == {"MainThread", "genie-copy"}, names
    with pytest.raises(ValueError, match="copying 4 bytes into 3"):
        memcopy.copy_buffer(bytearray(3), bytes(4))
    with pytest.raises(ValueError, match="read-only"):
        memcopy.copy_buffer(bytes(4), bytes(4))


def test_a_copy_lands_whole_when_its_threads_are_gone_fails_loudly_and_outlasts_an_interrupt(monkeypatch):
    """memcopy's edges: at interpreter shutdown (a pool that takes no more tasks) the caller copies
    every piece itself; a piece that fails raises, never a silent partial copy; an interrupt while
    the pieces run is raised only once every piece is done (none writes after `copy` returns)."""
    import concurrent.futures

    import numpy as np

    from genie_core.dataplane import memcopy

    monkeypatch.setattr(memcopy, "THREADS", 4)
    src = np.random.default_rng(1).integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes()
    shut = concurrent.futures.ThreadPoolExecutor(1)
    shut.shutdown()
    monkeypatch.setattr(memcopy, "_pool", shut)
    dst = bytearray(8 * MiB)
    memcopy.copy_buffer(dst, src)
    assert bytes(dst) == src
    monkeypatch.setattr(memcopy, "_pool", None)  # (a pool of its own for the rest; monkeypatch ends it)
    move, done = memcopy._move, []

    def failing(d, s, n):
        if threading.current_thread() is not threading.main_thread():
            raise OSError("a piece failed")
        return move(d, s, n)

    monkeypatch.setattr(memcopy, "_move", failing)
    with pytest.raises(OSError, match="a piece failed"):
        memcopy.copy_buffer(bytearray(8 * MiB), src)

    def slow(d, s, n):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
        move(d, s, n)
        done.append(n)

    waits = [KeyboardInterrupt]
    real_wait = memcopy.wait

    def interrupted_wait(futures):
        if waits:
            raise waits.pop()()
        return real_wait(futures)

    monkeypatch.setattr(memcopy, "_move", slow)
    monkeypatch.setattr(memcopy, "wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        memcopy.copy_buffer(bytearray(8 * MiB), src)
    assert len(done) == 4 and sum(done) == 8 * MiB, done  # (all pieces done before it was raised)
    memcopy._threads().shutdown()


def test_a_forked_child_copies_without_its_parents_threads():
    """The copy pool's threads are not in a forked child: it makes its own (else its first big
    copy would wait forever on threads that do not exist there)."""
    import os

    from genie_core.dataplane import memcopy

    if memcopy.THREADS < 2:
        pytest.skip("one copy thread here: no pool to lose")
    memcopy.copy_buffer(bytearray(8 * MiB), bytes(8 * MiB))  # the parent's pool running
    pid = os.fork()
    if pid == 0:
        try:
            dst = bytearray(8 * MiB)
            memcopy.copy_buffer(dst, b"\1" * (8 * MiB))
            os._exit(0 if dst == b"\1" * (8 * MiB) else 1)
        finally:
            os._exit(2)
    for _ in range(100):  # 10 s at most
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's copy did not finish in 10 s")


class _StandInStream:
    """LABELLED STAND-IN for a CUDA stream or event (this machine has no GPU): every copy here is
    done when issued, so only the ring's pieces and byte offsets are checked, not their overlap
    (tests/test_gpu.py checks the ring on a GPU)."""

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record(self, stream=None):
        pass


def test_the_pinned_rings_pieces_land_at_their_offsets_both_ways(monkeypatch):
    """PinnedRing (worker/host_copies.py) with CPU buffers and stand-in streams: an upload and a
    download of 3 buffers and a bit, each piece copied by memcopy at its own offset."""
    import contextlib

    from genie_core.worker import host_copies

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _StandInStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    ring = host_copies.PinnedRing.__new__(host_copies.PinnedRing)  # (its __init__ pins memory: CUDA's)
    ring.device, ring.chunk = torch.device("cpu"), 2 * MiB
    ring.buffers = [torch.empty(ring.chunk, dtype=torch.uint8) for _ in range(host_copies.SLOTS)]
    ring.stream, ring.slot_ready = _StandInStream(), [_StandInStream() for _ in range(host_copies.SLOTS)]
    n = 3 * ring.chunk + 4097
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    there = torch.zeros(n, dtype=torch.uint8)
    ring.upload(src[1:], there[1:])  # (views that start past their storage's first byte)
    assert torch.equal(there[1:], src[1:]) and there[0] == 0
    back = torch.zeros(n, dtype=torch.uint8)
    ring.download(there[1:], back[1:])
    assert torch.equal(back[1:], src[1:]) and back[0] == 0
    with pytest.raises(ValueError, match="cannot copy"):  # (a shorter buffer: the copy would run past it)
        ring.download(there, back[: n // 2])
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        ring.upload(src[: n // 8 * 4].view(torch.int32), there[: n // 8 * 4])
    with pytest.raises(ValueError, match="cannot copy"):  # (the host side not in CPU memory)
        ring.upload(torch.empty(n, dtype=torch.uint8, device="meta"), there)
