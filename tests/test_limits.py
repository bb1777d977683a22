"""Per-session limits a server sets (`genie serve --max-session-tensors N --max-session-bytes SIZE`):
going over one is a clear LimitExceeded that loses nothing already held, and the session goes
on once it frees something. Limits are per session: a neighbour is not affected."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import run, session_on, start_server, stdout_of
from reliability import record

import genie_core
from genie_core.errors import LimitExceeded
from genie_core.remote_tensor.connection import stream_for
from genie_core.remote_tensor.stream import OpStream

SECTION = "Session limits"

DEV = "remote_accelerator:0"
MiB = 1 << 20


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("limits"), "--max-session-tensors", "40", "--max-session-bytes", "64MiB")
    with session_on(srv):
        yield srv


def test_too_many_remote_tensors(limited):
    kept = [torch.full((4,), float(i), device=DEV) for i in range(30)]
    assert kept[29].cpu().tolist() == [29.0] * 4
    more = [torch.ones(4, device=DEV) for _ in range(20)]
    with pytest.raises(
        LimitExceeded, match=r"hold 41 remote tensors; the server allows 40 \(--max-session-tensors\)"
    ) as caught:
        more[-1].cpu()
    assert not isinstance(caught.value, torch.OutOfMemoryError)  # (a smaller batch would not mend it)
    assert kept[5].cpu().tolist() == [5.0] * 4  # what it held before is intact
    record(
        SECTION,
        "41st remote tensor (--max-session-tensors 40)",
        f"LimitExceeded: {caught.value}; the 30 held before intact",
    )
    del more
    gc.collect()
    assert (torch.ones(4, device=DEV) * 3).cpu().tolist() == [3.0] * 4  # freed: goes on
    del kept
    gc.collect()


def test_too_many_bytes_of_remote_tensors(limited):
    a = torch.ones(10 * MiB, device=DEV)  # 40 MiB
    assert a.sum().item() == 10 * MiB
    b = torch.zeros(6 * MiB, device=DEV)  # 24 MiB more: 64 MiB + the sum's result > 64 MiB
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"would make this session hold 88\.0 MiB in remote tensors; the server allows 64\.0 MiB",
    ) as caught:
        (b + 1).cpu()
    # as accelerate's find_executable_batch_size tells an out-of-memory error (CUDA's words)
    assert len(caught.value.args) == 1 and caught.value.args[0].startswith("remote_accelerator out of memory. ")
    assert a[:3].cpu().tolist() == [1.0, 1.0, 1.0]
    del b
    gc.collect()
    assert (torch.ones(MiB, device=DEV) + a[:MiB]).sum().item() == 2 * MiB
    del a
    gc.collect()


def test_pushes_over_the_limit(limited):
    client = genie_core.get_cluster_state().client
    before = limited.segments()
    with pytest.raises(
        LimitExceeded, match=r"push of 80\.0 MiB is more than the server lets a session hold \(64\.0 MiB"
    ) as caught:
        client.push({"big": torch.ones(20 * MiB)})
    record(SECTION, "80 MiB push (--max-session-bytes 64MiB)", f"LimitExceeded before a byte was sent: {caught.value}")
    assert limited.segments() <= before  # refused before a byte was sent
    held = torch.ones(10 * MiB, device=DEV)  # 40 MiB of remote tensors
    assert held.sum().item() == 10 * MiB
    with pytest.raises(LimitExceeded, match=r"push of 32\.0 MiB would make this session hold 72\.0 MiB"):
        client.push({"mid": torch.ones(8 * MiB)})
    assert "mid" not in stdout_of(run(client, "print(sorted(k for k in dir() if not k.startswith('_')))"))
    client.push({"small": torch.ones(MiB)})  # 4 MiB: fits
    assert stdout_of(run(client, "print(int(small.sum()))")) == f"{MiB}\n"
    del held
    gc.collect()


def test_an_upload_over_the_limit_is_refused_before_a_byte_moves(limited):
    held = torch.arange(1.0, device=DEV)
    before = limited.segments()
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"remote_accelerator tensor of 80\.0 MiB is more than the server lets a session hold",
    ) as caught:
        torch.ones(20 * MiB).to(DEV)  # (its empty destination is refused first)
    with pytest.raises(torch.OutOfMemoryError, match=r"upload to remote_accelerator of 80\.0 MiB is more than"):
        held + torch.ones(20 * MiB)  # (a CPU argument travels with the op)
    record(
        SECTION,
        "80 MiB .to(remote) (--max-session-bytes 64MiB)",
        f"LimitExceeded before a byte was sent: {caught.value}",
    )
    assert limited.segments() <= before
    assert held.cpu().tolist() == [0.0]  # the session and what it held go on
    assert torch.ones(MiB).to(DEV).sum().item() == MiB


def test_a_part_of_an_upload_over_the_limit_fails_it_and_keeps_the_rest(limited, monkeypatch):
    """An upload in parts (a GPU server's, past UPLOAD_PART) whose first part passes the server's
    limit fails as one upload would, naming the limit; its later parts do nothing, and the tensors
    held before stay intact."""
    monkeypatch.setenv("GENIE_UPLOAD_SEGMENTS", "lent")
    monkeypatch.setattr(OpStream, "UPLOAD_PART", MiB)
    kept = [torch.full((4,), float(i), device=DEV) for i in range(39)]  # then .to()'s destination: 40
    assert kept[38].cpu().tolist() == [38.0] * 4
    stream = stream_for(0)
    sent = stream.messages
    with pytest.raises(LimitExceeded, match=r"a tensor sent from here would make this session hold 41 remote"):
        torch.ones(MiB).to(DEV).cpu()  # 4 MiB: 4 parts, a batch each
    assert stream.messages - sent >= 4
    assert [t.cpu().tolist() for t in kept[::13]] == [[float(i)] * 4 for i in range(0, 39, 13)]
    del kept
    gc.collect()
    assert torch.equal(torch.arange(float(MiB)).to(DEV).cpu(), torch.arange(float(MiB)))


def test_limits_are_per_session(limited):
    kept = [torch.ones(2, device=DEV) for _ in range(35)]
    kept[0].cpu()
    other = limited.client()
    try:
        assert stdout_of(run(other, "import torch; t = [torch.ones(2) for _ in range(100)]; print(len(t))")) == "100\n"
        other.push({"x": torch.ones(10 * MiB)})  # 40 MiB: its own allowance
    finally:
        other.close()
    del kept
    gc.collect()


def test_the_data_port_refuses_a_put_over_the_limit_before_taking_memory(limited):
    from genie_core.dataplane.tcp import TcpChannel

    client = genie_core.get_cluster_state().client
    port = client.node["transport"]["data_port"]
    transport = TcpChannel("127.0.0.1", port, client.connection.codec.key, client.session)
    before = limited.segments("genie-s-")
    with pytest.raises((ConnectionError, OSError)):
        transport.put([bytearray(65 * MiB)])
    transport.close()
    assert limited.segments("genie-s-") <= before
    ok = TcpChannel(
        "127.0.0.1", port, client.connection.codec.key, client.session
    )  # the same put, under the limit, is taken
    assert ok.put([bytearray(MiB)])["sizes"] == [MiB]
    ok.close()


def test_limits_show_in_the_server_info(limited):
    limits = genie_core.get_cluster_state().client.node["limits"]
    assert limits["session_tensors"] == 40 and limits["session_bytes"] == 64 * MiB
