"""What signing costs: a 256 MiB push over the zmq backend (every byte signed on the client and
verified on the server) beside the same bytes through a bare, unsigned pyzmq socket pair, and
the signature alone (sign + verify) on those bytes. Also what `genie serve --encrypt` costs: the
same push to a CurveZMQ server (where zmq is the only network data path).

Target (issue 8): signing adds little to a large transfer; the measure is the push's time over
the unsigned pair's, and the share of the push that signing takes."""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch
import zmq

from genie_core.client import Client
from genie_core.protocol import Codec, Message

from . import _servers


class BarePair:
    """A DEALER -> ROUTER pair on loopback tcp with a thread that answers each message: the
    transport Genie's zmq backend rides on, without Genie (no signing, no server, no worker)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            frames = self.router.recv_multipart(copy=False)
            if len(frames) == 2 and bytes(frames[1]) == b"stop":
                return
            self.router.send_multipart([frames[0], b"ok"])

    def once(self, payload: memoryview) -> float:
        start = time.perf_counter()
        self.dealer.send_multipart([b"push", payload], copy=False)
        self.dealer.recv()
        return time.perf_counter() - start

    def close(self) -> None:
        self.dealer.send(b"stop")
        self.thread.join(10)
        self.ctx.destroy(linger=0)


def run(quick: bool = False) -> dict:
    nbytes = (16 if quick else 256) << 20
    rounds = 2 if quick else 7
    t = torch.randn(nbytes // 4)
    payload = memoryview(t.numpy()).cast("B")
    codec = Codec(os.urandom(32))
    proc, info = _servers.start()
    enc_proc, enc_info = _servers.start("--encrypt", "--no-ucx")
    results: dict[str, list[float]] = {}
    try:
        client = Client(info.ip, info.port, info.token, timeout=60).connect()
        client.select_backend("zmq")
        encrypted = Client(enc_info.ip, enc_info.port, enc_info.token, timeout=60, curve=enc_info.curve).connect()
        encrypted.select_backend("zmq")
        pair = BarePair()
        client.push({"t": t})  # warm all three
        encrypted.push({"t": t})
        pair.once(payload)
        message = Message("push", {}, [payload])
        for _ in range(rounds):  # interleaved
            start = time.perf_counter()
            client.push({"t": t})
            results.setdefault("genie_zmq_push", []).append(time.perf_counter() - start)
            results.setdefault("bare_zmq_pair", []).append(pair.once(payload))
            start = time.perf_counter()
            encrypted.push({"t": t})
            results.setdefault("genie_zmq_push_encrypted", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            frames = codec.pack(message)
            codec.unpack(frames)
            results.setdefault("sign_and_verify", []).append(time.perf_counter() - start)
        pair.close()
        client.close()
        encrypted.close()
    finally:
        _servers.stop(proc)
        _servers.stop(enc_proc)
    med = {k: statistics.median(v) for k, v in results.items()}
    out: dict = {"name": "message_signing", "mib": nbytes >> 20, "rounds": rounds}
    for k, v in med.items():
        out[f"{k}_s_p50"] = round(v, 4)
        out[f"{k}_gib_s"] = round(nbytes / v / 1024**3, 3)
    out["push_vs_bare_pair"] = round(med["genie_zmq_push"] / med["bare_zmq_pair"], 2)
    out["signing_share_of_push"] = round(med["sign_and_verify"] / med["genie_zmq_push"], 3)
    out["encrypted_push_vs_signed_push"] = round(med["genie_zmq_push_encrypted"] / med["genie_zmq_push"], 2)
    out["targets"] = "signing (sign + verify) under a quarter of a 256 MiB push's time"
    out["met"] = {"signing_share": out["signing_share_of_push"] < 0.25}
    return out
