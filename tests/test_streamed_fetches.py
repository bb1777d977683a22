"""Fetches through a data port while the worker still fills the segment (dataplane/filling.py,
worker/staging.py): the port's side against a real client exchange over a socket pair, and a real
server whose worker is killed halfway through filling."""

from __future__ import annotations

import mmap
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
import torch
from conftest import run, start_server, worker_pid

import genie_core
from genie_core.dataplane import stream, tcp
from genie_core.dataplane.base import DATA_THRESHOLD
from genie_core.dataplane.filling import Filling, Fillings
from genie_core.dataplane.segment import SENT, SHM_DIR, LateBuffer, Segment
from genie_core.errors import RemoteError, WorkerDied

KEY, SESSION = os.urandom(32), "session-a"
MIB = 1 << 20


class Port:
    """A data port's exchange (stream.serve) on one end of a socket pair, the client on the other."""

    def __init__(self) -> None:
        self.host = stream.DataHost(KEY, lambda s: [os.getpid()] if s == SESSION else None, fillings=Fillings())
        here, there = socket.socketpair()
        self.sock = here
        self.thread = threading.Thread(target=self._serve, args=(there,), daemon=True)
        self.thread.start()
        self.macs = tcp.drive(here, stream.authenticate(KEY, SESSION, want_mac=True))

    def _serve(self, sock: socket.socket) -> None:
        exchange = stream.serve(self.host, mac_on=True)
        try:
            tcp.drive(sock, exchange)
        except (ConnectionError, OSError):
            pass
        finally:
            exchange.close()
            sock.close()

    def get(self, segment: Segment, size: int, progress=None) -> bytes:
        into = memoryview(bytearray(size))
        ref = {"segment": segment.name, "sizes": [size]}
        (got,) = tcp.drive(self.sock, stream.get(self.macs, ref, into, progress))
        return bytes(got)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


@pytest.fixture
def port():
    p = Port()
    yield p
    p.close()


def staged(size: int, reusable: bool, fillings: Fillings) -> Segment:
    """A segment as a worker stages it for a streamed fetch: taken, announced, not yet filled."""
    segment = Segment.create("genie-w", size)
    fillings.begin(os.getpid(), segment.name, size, SESSION, reusable)
    return segment


def fill(segment: Segment, data: bytes, fillings: Fillings, parts: int, stop_at: int | None = None, before_last=None):
    """What the worker does after its reply: copy the bytes in part by part, saying how far it got
    (and, for a test, wait for `before_last` before the last part)."""
    step = len(data) // parts
    for i in range(parts):
        if i == stop_at:
            fillings.advance(os.getpid(), 0, "MemoryError", "stopped halfway")
            return
        if i == parts - 1 and before_last is not None:
            assert before_last.wait(10)
        end = len(data) if i == parts - 1 else (i + 1) * step
        segment.view[i * step : end] = data[i * step : end]
        fillings.advance(os.getpid(), end)


def test_a_fetch_is_sent_while_its_worker_fills_it_and_arrives_whole(port):
    """The port sends each part once the worker says it is there: the worker fills its last part
    only once the client has had bytes (it would wait in vain for a port that sent nothing before
    the whole was in), and every byte is the worker's."""
    size = 16 * MIB
    data = os.urandom(size)
    segment = staged(size, reusable=False, fillings=port.host.fillings)
    first_bytes = threading.Event()
    worker = threading.Thread(target=fill, args=(segment, data, port.host.fillings, 8, None, first_bytes))
    worker.start()
    got = port.get(segment, size, lambda done, total: first_bytes.set())
    worker.join()
    assert got == data
    assert not segment.path.exists()  # not reusable: its name went as it was mapped


def test_a_filling_that_fails_fails_the_fetch_in_one_error_and_the_connection_goes_on(port):
    """A worker that stops filling (an error, or its death) makes the fetch raise what it says,
    after the port has sent what there was; the trailer keeps the connection in step, so the next
    fetch on it works."""
    size = 8 * MIB
    segment = staged(size, reusable=True, fillings=port.host.fillings)
    worker = threading.Thread(target=fill, args=(segment, os.urandom(size), port.host.fillings, 4, 2))
    worker.start()
    with pytest.raises(RemoteError, match="could not send these bytes: stopped halfway"):
        port.get(segment, size)
    worker.join()
    assert not (SHM_DIR / (segment.name + SENT)).exists()  # a failed one is not handed back to be refilled
    segment.unlink()

    again = staged(size, reusable=False, fillings=port.host.fillings)
    port.host.fillings.worker_gone(os.getpid(), "the session's worker process (pid 1) ended while staging")
    with pytest.raises(WorkerDied, match="ended while staging"):
        port.get(again, size)

    swept = staged(size, reusable=False, fillings=port.host.fillings)  # its worker gone, its segment swept
    port.host.fillings.worker_gone(os.getpid(), "the session's worker process (pid 1) ended while staging")
    swept.unlink()
    with pytest.raises(WorkerDied, match="ended while staging"):
        port.get(swept, size)

    data = os.urandom(size)
    last = staged(size, reusable=True, fillings=port.host.fillings)
    fill(last, data, port.host.fillings, 2)
    try:
        assert port.get(last, size) == data
    finally:
        last.close()
        last.unlink()  # (and its name handed back)


def test_a_sent_segment_goes_back_to_its_worker_to_be_filled_again(port):
    """A reusable segment (its worker is not sandboxed) keeps its memory: once sent it is renamed
    for its worker, which takes it back and fills it for the next fetch (no fresh page faults)."""
    size = 4 * MIB
    segment = staged(size, reusable=True, fillings=port.host.fillings)
    data = os.urandom(size)
    fill(segment, data, port.host.fillings, 2)
    assert port.get(segment, size) == data
    assert (SHM_DIR / (segment.name + SENT)).exists() and not segment.path.exists()
    assert segment.taken_back() and segment.path.exists()
    assert not segment.taken_back()  # (once)
    segment.close()
    segment.unlink()


def test_a_worker_that_stalls_fails_the_wait_after_its_stall_limit():
    filling = Filling("genie-w-1-aa", SESSION, 10)
    filling.advance(4)
    start = time.monotonic()
    filling.wait_for(10, stall=0.2)
    assert 0.2 <= time.monotonic() - start < 2
    assert filling.outcome() == {
        "ok": False,
        "ename": "TimeoutError",
        "evalue": "the worker staged nothing more for 0.2 s",
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("streamed-fetches"))
    yield srv
    srv.stop()


@pytest.fixture
def state(server):
    yield genie_core.init_sync(f"127.0.0.1:{server.info.port}", token=server.info.token, backend="tcp", timeout=20)
    genie_core.shutdown_sync()


def test_fetches_over_tcp_reuse_the_workers_segment(state):
    """Two pulls of one size through the data port: the worker fills the same segment both times."""
    client = state.client
    names = []
    real_get = client.channel.get

    def get(ref, progress=None):
        names.append(ref["segment"])
        return real_get(ref, progress)

    client.channel.get = get
    t = torch.randn(2 * MIB)
    client.push({"t": t})
    assert torch.equal(client.pull(["t"])["t"], t)
    t2 = t + 1
    client.push({"t": t2})
    assert torch.equal(client.pull(["t"])["t"], t2)
    assert len(names) == 2 and names[0] == names[1]


def test_a_worker_killed_while_it_fills_a_fetch_is_a_clear_error_and_the_session_goes_on(state):
    """The worker is stopped just after its reply, while its segment is still part zeros (a fresh
    segment, bytes of 1.0 going in), then killed: the pull fails with WorkerDied within seconds, not
    after the stall limit, and the next pull on the same data connection works."""
    client = state.client
    size = 256 * MIB
    real_get = client.channel.get
    outcomes: list[str] = []

    def get_after_a_kill(ref, progress=None):
        os.kill(pid, signal.SIGSTOP)
        with open(SHM_DIR / ref["segment"], "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            tail = np.frombuffer(m, dtype=np.float32, count=1024, offset=size - 4096).copy()
        filled = bool((tail == value).all())  # (a segment filled again holds the last try's values)
        os.kill(pid, signal.SIGCONT if filled else signal.SIGKILL)  # filled already: nothing to test this time
        outcomes.append("late" if filled else "killed")
        return real_get(ref, progress)

    for attempt in range(5):  # bounded: each try kills (or misses) one worker
        value = float(attempt + 1)
        run(client, f"import torch; x = torch.full((64 << 20,), {value})")  # 256 MiB, made on the worker
        pid = worker_pid(client)
        client.channel.get = get_after_a_kill
        start = time.monotonic()
        try:
            client.pull(["x"])
        except WorkerDied as exc:
            assert "ended while staging" in str(exc) and outcomes[-1] == "killed"
            assert time.monotonic() - start < 30
            outcomes.append("failed")
        finally:
            client.channel.get = real_get
        if outcomes[-1] != "late":
            break
    assert outcomes[-2:] == ["killed", "failed"], outcomes
    run(client, "import torch; y = torch.full((4 << 20,), 2.0)")
    assert torch.equal(client.pull(["y"])["y"], torch.full((4 << 20,), 2.0))


def test_a_filling_is_only_taken_for_its_own_session():
    """A data port gives a filling's bytes (unchecked by worker pid: the server registered it) only
    to the session it was staged for."""
    fillings = Fillings()
    mine = f"genie-w-{os.getpid()}-aa"
    fillings.begin(os.getpid(), mine, 10, SESSION, reusable=False)
    assert fillings.take(mine, "session-b") is None
    assert fillings.take(mine, SESSION) is not None
    fillings.begin(os.getpid(), "genie-s-1-bb", 10, SESSION, reusable=True)  # not a name this worker made
    assert fillings.take("genie-s-1-bb", SESSION) is None


def test_the_server_remembers_only_the_last_fillings_whose_worker_died(monkeypatch):
    """A fetch that comes after its worker died says WorkerDied (its filling is kept), but a
    server whose workers keep dying does not keep every such filling: the oldest go."""
    import genie_core.dataplane.filling as filling_module

    monkeypatch.setattr(filling_module, "KEPT_FAILED", 2)
    fillings = Fillings()
    names = []
    for pid in (101, 102, 103, 104):
        names.append(f"genie-w-{pid}-aa")
        fillings.begin(pid, names[-1], 10, SESSION, reusable=False)
        fillings.worker_gone(pid, f"worker {pid} ended")
    assert fillings.take(names[0], SESSION) is None and fillings.take(names[1], SESSION) is None
    late = fillings.take(names[3], SESSION)
    assert late is not None and late.outcome() == {"ok": False, "ename": "WorkerDied", "evalue": "worker 104 ended"}


def test_a_worker_whose_copy_fails_after_its_reply_says_why():
    """The reply has gone when the copy into the segment fails: the worker's `staging` message
    names the error (the data port's trailer passes it on), and the worker serves on."""
    from genie_core.protocol import MessageType as T
    from genie_core.worker.staging import PART, Stager

    sent: list = []
    gone = mmap.mmap(-1, 8 * MIB)

    def send(kind, content, buffers=None):
        sent.append((kind, dict(content)))
        if kind is T.STAGING:
            gone.close()  # the second buffer cannot be read any more

    staging = Stager(send)
    try:
        staging.reply(T.PULL_REPLY, {"status": "ok"}, [bytes(PART), gone], {"staged": True, "streamed": True})
        assert [kind for kind, _ in sent] == [T.PULL_REPLY, T.STAGING, T.STAGING]
        assert sent[0][1]["data"]["filling"] and sent[1][1] == {"filled": PART}
        assert sent[2][1]["ename"] == "ValueError"
    finally:
        staging.staged.close()
        staging.staged.unlink()


def test_a_segment_sent_after_its_worker_has_gone_is_not_handed_back():
    """Once a worker is gone its segments are swept; a name handed back after that would stay in
    /dev/shm for good, so a segment whose worker went while it was being sent is left to go."""
    fillings = Fillings()
    segment = staged(MIB, reusable=True, fillings=fillings)
    fillings.advance(os.getpid(), MIB)
    filling = fillings.take(segment.name, SESSION)
    fillings.worker_gone(os.getpid(), "the session's worker process ended")
    filling.sent()
    assert segment.path.exists() and not (SHM_DIR / (segment.name + SENT)).exists()
    segment.close()
    segment.unlink()


def test_a_worker_says_how_far_it_got_per_part_and_keeps_no_segment_over_its_cap(monkeypatch):
    """A pull of many small buffers is announced per PART, not per buffer (each message crosses the
    server's loop, shared by all sessions); a segment over KEEP_MAX is not kept for the next fetch
    (it would hold that much of /dev/shm): the reply says so and the worker lets its mapping go."""
    from genie_core.protocol import MessageType as T
    from genie_core.worker import staging as staging_module

    monkeypatch.setattr(staging_module, "KEEP_MAX", 32 * MIB)
    sent: list = []
    stager = staging_module.Stager(lambda kind, content, buffers=None: sent.append((kind, dict(content))))
    small = [bytes(64 << 10)] * 512  # 32 MiB in 512 buffers
    try:
        stager.reply(T.PULL_REPLY, {"status": "ok"}, small, {"staged": True, "streamed": True})
        assert [kind for kind, _ in sent] == [T.PULL_REPLY, T.STAGING]
        assert sent[0][1]["data"]["reused"] and not stager.staged.map.closed
        sent.clear()
        stager.reply(T.PULL_REPLY, {"status": "ok"}, [*small, *small], {"staged": True, "streamed": True})
        assert [kind for kind, _ in sent] == [T.PULL_REPLY, T.STAGING, T.STAGING]
        assert not sent[0][1]["data"]["reused"] and stager.staged.map.closed
    finally:
        stager.staged.unlink()


class Pattern(LateBuffer):
    """Stands in for a GPU tensor's bytes (host_copies.DeviceBytes: this machine has no GPU): written
    in 3 MiB parts, each reported, into whatever memory it is given; it notes whose memory that was."""

    def __init__(self, nbytes: int, seed: int) -> None:
        self.nbytes = nbytes
        self.values = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        self.written_into: list = []

    def write_into(self, dst, progress=None):
        out = np.frombuffer(dst, dtype=np.uint8)
        self.written_into.append(dst.obj)
        for start in range(0, self.nbytes, 3 * MIB):
            out[start : start + 3 * MIB] = self.values[start : start + 3 * MIB]
            if progress is not None:
                progress(min(start + 3 * MIB, self.nbytes))


@pytest.mark.parametrize("streamed", [False, True])
def test_a_gpu_tensors_bytes_are_written_straight_into_the_staged_segment(streamed):
    """A fetch's bytes still on the GPU (a LateBuffer) are written into the staged segment itself, no
    memory of their own between, beside plain buffers, each part announced when streamed; sent
    inline (too small, or not asked staged), they get memory of their own."""
    from genie_core.protocol import MessageType as T
    from genie_core.worker.staging import PART, Stager

    sent: list = []
    stager = Stager(lambda kind, content, buffers=None: sent.append((kind, dict(content), buffers)))
    head, late, tail = bytes(range(256)) * 40, Pattern(2 * PART + 5, seed=1), Pattern(7 * MIB, seed=2)
    try:
        stager.reply(T.PULL_REPLY, {"status": "ok"}, [head, late, tail], {"staged": True, "streamed": streamed})
        segment = stager.staged
        ref = sent[0][1]["data"]
        assert ref["sizes"] == [len(head), late.nbytes, tail.nbytes] and ref["segment"] == segment.name
        assert [o is segment.map for o in late.written_into + tail.written_into] == [True, True]
        got = np.frombuffer(Segment.attach(segment.name).view, dtype=np.uint8)[: sum(ref["sizes"])]
        assert bytes(got[: len(head)]) == head
        assert np.array_equal(got[len(head) : len(head) + late.nbytes], late.values)
        assert np.array_equal(got[len(head) + late.nbytes :], tail.values)
        if streamed:
            filled = [content["filled"] for kind, content, _ in sent[1:]]
            assert all(kind is T.STAGING for kind, _, _ in sent[1:])
            assert filled == sorted(filled) and filled[-1] == sum(ref["sizes"]) and len(filled) >= 3
    finally:
        stager.spares.close()  # (the spare a reply filled before it made for the next: not left in /dev/shm)
        if stager.staged is not None:
            stager.staged.close()
            stager.staged.unlink()
    sent.clear()
    small = Pattern(DATA_THRESHOLD - 1, seed=3)
    stager.reply(T.PULL_REPLY, {"status": "ok"}, [small], {"staged": True, "streamed": streamed})
    ((kind, content, buffers),) = sent
    assert kind is T.PULL_REPLY
    assert "data" not in content and np.array_equal(np.frombuffer(buffers[0], dtype=np.uint8), small.values)


class Broken(LateBuffer):
    """Stands in for a GPU tensor whose copy to the host fails (a CUDA error surfacing late)."""

    nbytes = 8 * MIB

    def write_into(self, dst, progress=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (a stand-in)")


@pytest.mark.parametrize("streamed", [False, True])
def test_a_gpu_copy_that_fails_is_one_error_and_leaves_no_segment_behind(streamed):
    """Filled before its reply (shm): the error is the reply, and the segment is gone; filled after
    it (a data port): a `staging` message names the error (the port's trailer passes it on)."""
    from genie_core.protocol import MessageType as T
    from genie_core.worker.staging import Stager

    sent: list = []
    stager = Stager(lambda kind, content, buffers=None: sent.append((kind, dict(content))))
    before = set(SHM_DIR.glob("genie-w-*"))
    if not streamed:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            stager.reply(T.PULL_REPLY, {"status": "ok"}, [Broken()], {"staged": True})
        assert sent == [] and stager.staged is None and set(SHM_DIR.glob("genie-w-*")) == before
        return
    try:
        stager.reply(T.PULL_REPLY, {"status": "ok"}, [Broken()], {"staged": True, "streamed": True})
        assert [kind for kind, _ in sent] == [T.PULL_REPLY, T.STAGING]
        assert sent[1][1]["ename"] == "RuntimeError" and "illegal memory access" in sent[1][1]["evalue"]
    finally:
        stager.staged.close()
        stager.staged.unlink()
