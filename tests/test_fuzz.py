"""Hostile input: at least 100,000 malformed, truncated, oversized, unsigned, forged and replayed
messages at a live server. It must answer a valid client throughout, execute nothing it should
not, and keep its memory flat."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import psutil
import zmq
from conftest import run, start_server, stdout_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import record

from genie_core.protocol import PROTOCOL, Codec, Message, derive_key

TOTAL = 100_000
LIMIT = 1 << 20  # the server under test refuses messages over 1 MiB


def test_fuzzed_messages_are_dropped_and_the_server_keeps_serving(tmp_path):
    srv = start_server(tmp_path, env={"GENIE_MAX_MESSAGE_BYTES": str(LIMIT)})
    marker = tmp_path / "executed"
    evil = f"open({str(marker)!r}, 'a').write('x')"
    client = srv.client(timeout=30)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.connect(f"tcp://127.0.0.1:{srv.info.port}")
    proc = psutil.Process(srv.proc.pid)
    try:
        run(client, "x = 1")  # the valid session works, its worker is up
        rss_before = proc.memory_info().rss
        good = Codec(derive_key(srv.info.token))
        wrong = Codec(derive_key("not-the-token"))
        rng = np.random.default_rng(8)
        sent = 0
        pings: list[float] = []
        rss: dict[int, int] = {}

        def send(frames: list) -> None:
            nonlocal sent
            try:
                sock.send_multipart(frames)
            except zmq.Again:
                raise AssertionError(
                    f"the server stopped reading after {sent} messages: {[bytes(f)[:20] for f in frames]}"
                ) from None
            sent += 1
            if sent % 5000 == 0:  # a valid client is answered throughout
                pings.append(client.ping(timeout=10))
                rss[sent] = proc.memory_info().rss

        # A valid execute, captured and replayed: it may run once, and only once.
        hello = good.pack(Message("hello", seq=1))
        sock.send_multipart(hello)
        assert sock.poll(5000)
        session = good.unpack(sock.recv_multipart()).content["session"]
        replay = good.pack(Message("execute", {"code": evil}, session=session, seq=2))
        for _ in range(500):
            send(replay)

        # Structured junk from hypothesis: plausible headers, wrong or missing signatures, bad sequence numbers.
        json_values = st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
            max_leaves=8,
        )

        @settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(
            kind=st.sampled_from(["execute", "push", "pull", "hello", "ping", "interrupt", "close", "info", "x"]),
            content=st.dictionaries(st.text(max_size=10), json_values, max_size=4),
            seq=st.integers(min_value=-5, max_value=2),
            signer=st.sampled_from(["wrong", "none", "good-bad-seq"]),
            buffers=st.lists(st.binary(max_size=64), max_size=3),
        )
        def structured(kind, content, seq, signer, buffers):
            content = dict(content, code=evil)
            msg = Message(kind, content, buffers, session=session if signer == "good-bad-seq" else "nope", seq=seq)
            codec = {"wrong": wrong, "none": Codec(None), "good-bad-seq": good}[signer]
            send(codec.pack(msg))

        structured()

        # Truncated and oversized copies of real messages.
        for i in range(2000):
            frames = wrong.pack(Message("execute", {"code": evil}, seq=i))
            send(frames[: rng.integers(0, len(frames))] or [b""])
        for _ in range(20):  # over the limit: the server drops that connection, so each comes on its own
            oversized = ctx.socket(zmq.DEALER)
            oversized.setsockopt(zmq.LINGER, 1000)
            oversized.connect(f"tcp://127.0.0.1:{srv.info.port}")
            oversized.send_multipart([PROTOCOL, b"", b"{}", b"{}", os.urandom(LIMIT + 1)])
            oversized.close()
            sent += 1

        # Bulk random frames, some behind a valid protocol tag.
        while sent < TOTAL:
            n = int(rng.integers(1, 7))
            frames = [rng.bytes(int(rng.integers(0, 200))) for _ in range(n)]
            if rng.random() < 0.5:
                frames[0] = PROTOCOL
            send(frames)

        pings.append(client.ping(timeout=10))
        time.sleep(1.0)
        rss_after = proc.memory_info().rss
        assert srv.proc.poll() is None
        assert stdout_of(run(client, "print(x + 1)")) == "2\n"
        ran = marker.read_text() if marker.exists() else ""
        assert ran == "x", f"the replayed execute ran {len(ran)} times; forged ones must never run"
        growth = (rss_after - rss_before) / 2**20
        half = min(rss, key=lambda n: abs(n - TOTAL // 2))
        second_half = (rss_after - rss[half]) / 2**20
        assert second_half < 5, f"server memory grew {second_half:.1f} MiB over the second half of the flood: a leak"
        record("Fuzzing (tests/test_fuzz.py)", "messages sent", f"{sent:,}")
        record("Fuzzing (tests/test_fuzz.py)", "executions of a captured execute replayed 500 times", str(len(ran)))
        record("Fuzzing (tests/test_fuzz.py)", "forged, unsigned or truncated executes run", "0")
        record(
            "Fuzzing (tests/test_fuzz.py)",
            "server RSS growth, whole run / second half (MiB)",
            f"{growth:.1f} / {second_half:.1f}",
        )
        record(
            "Fuzzing (tests/test_fuzz.py)",
            "valid client's ping during the flood, median / max (ms)",
            f"{statistics.median(pings) * 1e3:.1f} / {max(pings) * 1e3:.1f}",
        )
    finally:
        sock.close()
        ctx.term()
        client.close()
        srv.stop()
