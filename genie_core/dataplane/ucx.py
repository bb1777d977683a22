"""`ucx`: bulk bytes through UCX (the `ucxx` bindings), which uses RDMA (InfiniBand, RoCE) and
GPU transports where the system's UCX has them, and TCP or shared memory otherwise.

Both ends run the exchange of `stream` (the tcp backend's) on ucxx's asyncio API, from a
private event-loop thread. Payloads always carry a MAC: a UCX peer's address is not visible here,
so there is no telling loopback from a network."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import AuthenticationError, ConnectionFailed
from ..protocol.contents import DataRef
from . import stream, wire
from .base import Backend, Candidate, Channel, Found, Link, ServerSide, measure_stream
from .segment import memory_spares, split
from .tcp import ENCRYPTED

log = logging.getLogger("genie.ucx")

SLICE = 64 << 20  # bytes per UCX message (a multiple of the MAC's 4 MiB chunks)


def available() -> tuple[bool, str]:
    """Whether ucxx can be used here, and why not."""
    if importlib.util.find_spec("ucxx") is None:
        return False, "the ucxx bindings are not installed (pip install 'genie-jupyter[ucx]')"
    os.environ.setdefault("UCX_RNDV_SCHEME", "put_zcopy")  # large messages: measured 2.3 vs 1.65 GiB/s over TCP
    os.environ.setdefault("UCX_LOG_LEVEL", "error")  # UCX writes its warnings to stdout: keep it for real errors
    try:
        import ucxx
    except Exception as exc:  # ImportError, or a library that fails to load
        return False, f"the ucxx bindings are not usable ({exc}); pip install 'genie-jupyter[ucx]'"
    return True, "ucxx " + getattr(ucxx, "__version__", "")


@functools.cache
def _waits() -> ThreadPoolExecutor:
    """Threads for waits on a worker's filling (up to its stall limit each), apart from asyncio's
    default ones, which the MAC's hashing needs meanwhile."""
    return ThreadPoolExecutor(max_workers=32, thread_name_prefix="genie-ucx-fill")


def _array(view: memoryview) -> Any:
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8)


async def drive(ep: Any, exchange: stream.Exchange) -> Any:
    """Run one side of the exchange over a UCX endpoint; payload pieces are hashed on other
    threads while the next piece is on the wire."""
    value: Any = None
    while True:
        try:
            step = exchange.send(value)
        except StopIteration as stop:
            return stop.value
        value = None
        if isinstance(step, stream.Send):
            await ep.send_obj(step.data)
        elif isinstance(step, stream.Receive):
            value = bytes(await ep.recv_obj())
            if len(value) != step.size:
                raise ConnectionError(f"expected {step.size} bytes, got {len(value)}")
        elif isinstance(step, stream.SendHeader):
            await ep.send_obj(wire.encode_header(step.header))
        elif isinstance(step, stream.ReceiveHeader):
            value = wire.decode_header(bytes(await ep.recv_obj()), step.limit)
        elif isinstance(step, stream.SendPayload):
            await _send_payload(ep, step)
        else:
            value = await _receive_payload(ep, step)


async def _send_payload(ep: Any, step: stream.SendPayload) -> None:
    total = sum(memoryview(b).nbytes for b in step.buffers)
    try:
        for piece, end in stream.cut(step.buffers, SLICE):
            if step.filling is not None and not step.filling.ready(end):
                await asyncio.wrap_future(_waits().submit(step.filling.wait_for, end))
            if step.mac is not None:
                step.mac.update(piece)  # hashed while it is sent
            await ep.send(_array(piece))
            if step.progress is not None:
                step.progress(end, total)
    except BaseException:
        if step.mac is not None:
            await asyncio.to_thread(step.mac.abandon)
        raise
    if step.mac is not None:
        await ep.send(_array(memoryview(await asyncio.to_thread(step.mac.digest))))


async def _receive_payload(ep: Any, step: stream.ReceivePayload) -> bool:
    total = len(step.view)
    try:
        for piece, end in stream.cut(split(step.view, step.pieces or [total]), SLICE):
            await ep.recv(_array(piece))
            if step.mac is not None:
                step.mac.update(piece)  # hashed while the next piece arrives
            if step.progress is not None:
                step.progress(end, total)
    except BaseException:
        if step.mac is not None:
            await asyncio.to_thread(step.mac.abandon)
        raise
    if step.mac is None:
        return True
    sent = bytearray(32)
    await ep.recv(_array(memoryview(sent)))
    return stream.mac_matches(step.mac, bytes(sent))


class _LoopThread:
    """An asyncio loop on its own thread, for code that is called synchronously."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class UcxChannel(Channel):
    name = "ucx"
    streams = True

    def __init__(self, host: str, port: int, key: bytes, session: str, timeout: float = 5.0) -> None:
        import ucxx

        self.address = f"{host}:{port}"
        self.runner = _LoopThread("genie-ucx-client")
        self.spares = memory_spares()

        async def connect() -> tuple[Any, wire.PayloadMacs]:
            ep = await ucxx.create_endpoint(host, port, connect_timeout=timeout)
            return ep, await drive(ep, stream.authenticate(key, session, want_mac=True))

        try:
            self.ep, self.macs = self.runner.run(connect(), timeout=timeout + 5)
        except PermissionError:
            self.runner.stop()
            raise AuthenticationError(f"the UCX port at {self.address} refused this session") from None
        except Exception as exc:
            self.runner.stop()
            raise ConnectionFailed(f"UCX endpoint {self.address} unusable: {exc}") from None

    def put(self, buffers: list[Any], progress: Any = None) -> DataRef:
        done: DataRef = self.runner.run(drive(self.ep, stream.put(self.macs, buffers, progress)))
        return done

    def get(self, ref: DataRef, progress: Any = None) -> list[Any]:
        total = sum(int(n) for n in ref["sizes"])
        into = self.spares.take(total, refill=False)
        buffers: list[Any] = self.runner.run(drive(self.ep, stream.get(self.macs, ref, into, progress)))
        self.spares.refill(total)
        return buffers

    def ping(self) -> float:
        start = time.perf_counter()
        self.runner.run(drive(self.ep, stream.ping()))
        return time.perf_counter() - start

    def sink(self, payload: memoryview) -> float:
        start = time.perf_counter()
        self.runner.run(drive(self.ep, stream.sink(self.macs, payload)))
        return time.perf_counter() - start

    def close(self) -> None:
        self.spares.close()
        try:
            self.runner.run(self.ep.close(), timeout=5)
        except Exception:
            pass
        self.runner.stop()


class Ucx(Backend):
    name = "ucx"
    slow_start = True  # importing ucxx costs about a second of CPU
    # Over a network without RDMA, UCX runs on TCP too, and its probe flatters it: across two
    # network namespaces here it measured 1.07x to 1.51x tcp's rate in the 4 sessions of 21 that
    # chose it, whose 32 MiB transfers then ran at 0.50 to 0.61 GiB/s where tcp's sessions ran at
    # 0.67 to 1.20 (benchmarks/RESULTS.md, "Which backend across hosts").
    rival = "tcp"
    margin = 2.0

    def offer(self, side: ServerSide) -> dict[str, Any]:
        if not side.enable_ucx:
            ok, reason = False, "off on this server (genie serve --no-ucx; an embedded server never needs it)"
        else:
            ok, reason = available()
        found = {"detect": {"ucx": {"available": ok, "reason": reason, "details": {}}}}
        if side.encrypted or not ok:
            return {"ucx_port": None, **found}
        import ucxx

        self.runner = _LoopThread("genie-ucx-server")

        async def handle(ep: Any) -> None:
            exchange = stream.serve(side.host, mac_on=True)
            try:
                await drive(ep, exchange)
            except Exception as exc:  # the client went away, or sent nonsense
                log.debug("ucx data connection ended: %s", exc)
            finally:
                exchange.close()

        async def listen() -> Any:
            return ucxx.create_listener(handle)

        try:
            self.listener = self.runner.run(listen(), timeout=30)
        except Exception as exc:
            log.warning("no ucx data plane: %s", exc)
            return {"ucx_port": None, **found}
        return {"ucx_port": self.listener.port, **found}

    def stop(self) -> None:
        if getattr(self, "listener", None) is not None:
            try:
                self.listener.close()
            except Exception:
                pass
        if getattr(self, "runner", None) is not None:
            self.runner.stop()

    def probe(self, link: Link, budget: float, found: Found) -> tuple[Candidate, Channel | None]:
        port = link.server.get("ucx_port")
        shm = found.get("shm")
        if link.server.get("encrypted"):
            return Candidate(self.name, False, ENCRYPTED), None
        if not port:
            reason = ((link.server.get("detect") or {}).get("ucx") or {}).get(
                "reason"
            ) or "offers no UCX port (no ucxx there, or still starting)"
            return Candidate(self.name, False, f"server: {reason}"), None
        if shm is not None and shm[0].available and link.requested not in ("ucx", "rdma"):
            # On one host shared memory is faster: not measured (nor ucxx imported, about a second).
            return Candidate(self.name, True, f"UCX port {port}; not measured: same host, where shm is faster"), None
        ok, reason = available()
        if not ok:
            return Candidate(self.name, False, f"here: {reason}"), None
        try:
            channel = UcxChannel(link.host, int(port), link.key, link.session, timeout=min(5.0, budget * 4))
            rtt, bandwidth = measure_stream(channel, budget)
        except (ConnectionFailed, AuthenticationError, OSError, ConnectionError) as exc:
            return Candidate(self.name, False, f"UCX port {link.host}:{port} not usable: {exc}"), None
        return Candidate(self.name, True, f"UCX port {port} ({reason})", rtt, bandwidth, {"port": int(port)}), channel
