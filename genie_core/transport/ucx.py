"""`ucx`: bulk bytes through UCX (the `ucxx` bindings), which uses RDMA (InfiniBand, RoCE) and
GPU transports where the system's UCX has them, and TCP or shared memory otherwise.

Both ends drive ucxx's asyncio API from a private event-loop thread. The exchange is the tcp
backend's: a challenge-response on the token, then `put` into a shared segment the session's
worker adopts, or `get` of a segment a worker staged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from typing import Any, Callable

from ..errors import AuthenticationError, ConnectionFailed
from . import wire
from .segment import Segment, memory_spares, segment_spares, split

log = logging.getLogger("genie.ucx")


def available() -> tuple[bool, str]:
    os.environ.setdefault("UCX_RNDV_SCHEME", "put_zcopy")  # large messages: measured 2.3 vs 1.65 GiB/s over TCP
    os.environ.setdefault("UCX_LOG_LEVEL", "error")  # UCX writes its warnings to stdout: keep it for real errors
    try:
        import ucxx  # noqa: F401
    except Exception as exc:  # ImportError, or a library that fails to load
        return False, f"the ucxx bindings are not usable ({exc}); pip install 'genie-jupyter[ucx]'"
    return True, "ucxx " + getattr(__import__("ucxx"), "__version__", "")


SLICE = 64 << 20  # bytes per UCX message: both ends cut a buffer the same way, so progress can follow


def _slices(view: memoryview) -> list[memoryview]:
    return [view[i : i + SLICE] for i in range(0, len(view), SLICE)] or [view]


class _PayloadMac:
    """Authenticates a payload: HMAC over the chunk digests of each piece, hashed on other threads
    while the next piece is on the wire (UCX payloads may cross a network, so always on)."""

    def __init__(self, key: bytes, label: bytes) -> None:
        self.key, self.label = key, label  # label: wire.PayloadMacs.label, binding connection, direction, count
        self.parts: list[asyncio.Future] = []

    def add(self, piece: memoryview) -> None:
        from ..protocol import chunk_digests

        self.parts.append(asyncio.get_running_loop().run_in_executor(None, chunk_digests, piece))

    async def digest(self) -> bytes:
        digests = await asyncio.gather(*self.parts)
        return hmac.new(self.key, self.label + b"".join(digests), hashlib.sha256).digest()


def _array(view: memoryview) -> Any:
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8)


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


async def _recv_json(ep: Any) -> dict[str, Any]:
    data = json.loads(bytes(await ep.recv_obj()))
    if not isinstance(data, dict):
        raise ConnectionError("header is not a JSON object")
    return data


async def _send_json(ep: Any, header: dict[str, Any]) -> None:
    await ep.send_obj(json.dumps(header, separators=(",", ":")).encode())


class UcxDataServer:
    """The server's UCX listener. `owners` maps segment names to the session that filled them."""

    def __init__(self, key: bytes, session_workers: Callable[[str], list[int] | None], owners: dict[str, str], max_put: int = 1 << 50) -> None:
        import ucxx

        self.key, self.session_workers, self.owners, self.max_put = key, session_workers, owners, max_put
        self.runner = _LoopThread("genie-ucx-server")

        async def listen() -> Any:
            return ucxx.create_listener(self._serve)

        self.listener = self.runner.run(listen(), timeout=30)
        self.port = self.listener.port

    def stop(self) -> None:
        try:
            self.listener.close()
        except Exception:
            pass
        self.runner.stop()

    async def _serve(self, ep: Any) -> None:
        made: list[Segment] = []
        spares = segment_spares("genie-s")
        scratch = bytearray(0)
        try:
            nonce = os.urandom(32)
            await ep.send_obj(wire.GREETING + nonce)
            hello = await _recv_json(ep)
            session = str(hello.get("session", ""))
            proof = bytes.fromhex(str(hello.get("proof", "")))
            if self.session_workers(session) is None or not hmac.compare_digest(proof, wire.handshake_mac(self.key, nonce, session)):
                await _send_json(ep, {"ok": False, "error": "authentication failed"})
                return
            await _send_json(ep, {"ok": True})
            macs = wire.PayloadMacs(self.key, nonce)
            while True:
                header = await _recv_json(ep)
                op = header.get("op")
                if op == "ping":
                    await _send_json(ep, {"ok": True})
                elif op == "put":
                    sizes = [int(n) for n in header["sizes"]]
                    wire.check_put(sizes, self.max_put)
                    made = [m for m in made if m.path.exists()]  # the rest were adopted by workers
                    segment = spares.take(sum(sizes), refill=False)
                    made.append(segment)
                    offset, mac = 0, _PayloadMac(self.key, macs.label(b"up"))
                    for n in sizes:
                        for piece in _slices(segment.view[offset : offset + n]):
                            await ep.recv(_array(piece))
                            mac.add(piece)
                        offset += n
                    sent_mac = bytearray(32)
                    await ep.recv(_array(memoryview(sent_mac)))
                    if not hmac.compare_digest(bytes(sent_mac), await mac.digest()):
                        segment.close()
                        made.remove(segment)
                        segment.unlink()
                        await _send_json(ep, {"ok": False, "error": "payload failed authentication"})
                        continue
                    segment.close()
                    self.owners[segment.name] = session
                    await _send_json(ep, {"ok": True, "segment": segment.name, "sizes": sizes})
                    spares.refill(sum(sizes))
                elif op == "get":
                    name = str(header["segment"])
                    parts = name.split("-")
                    pids = self.session_workers(session) or []
                    if len(parts) < 4 or parts[1] != "w" or not parts[2].isdigit() or int(parts[2]) not in pids:
                        await _send_json(ep, {"ok": False, "error": "no such staged data for this session"})
                        continue
                    view = Segment.adopt(name)
                    size = int(header["size"])
                    await _send_json(ep, {"ok": True, "size": size})
                    mac = _PayloadMac(self.key, macs.label(b"down"))
                    for piece in _slices(view[:size]):
                        mac.add(piece)
                        await ep.send(_array(piece))
                    await ep.send(_array(memoryview(await mac.digest())))
                elif op == "sink":  # discovery: receive and discard, into reused memory
                    n = int(header["size"])
                    if len(scratch) < n:
                        scratch = bytearray(n)
                    await ep.recv(_array(memoryview(scratch)[:n]))
                    await _send_json(ep, {"ok": True})
                else:
                    await _send_json(ep, {"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:  # the client went away, or sent nonsense
            log.debug("ucx data connection ended: %s", exc)
        finally:
            spares.close()
            for segment in made:
                if segment.path.exists():  # filled, never adopted
                    self.owners.pop(segment.name, None)
                    segment.unlink()


class UcxTransport:
    name = "ucx"

    def __init__(self, host: str, port: int, key: bytes, session: str, timeout: float = 5.0) -> None:
        import ucxx

        self.address = f"{host}:{port}"
        self.key = key
        self.runner = _LoopThread("genie-ucx-client")
        self.spares = memory_spares()

        async def connect() -> Any:
            ep = await ucxx.create_endpoint(host, port, connect_timeout=timeout)
            greeting = bytes(await ep.recv_obj())
            if not greeting.startswith(wire.GREETING):
                raise ConnectionFailed(f"{self.address} is not a genie UCX port")
            nonce = greeting[len(wire.GREETING):]
            await _send_json(ep, {"session": session, "proof": wire.handshake_mac(key, nonce, session).hex()})
            if not (await _recv_json(ep)).get("ok"):
                raise AuthenticationError(f"the UCX port at {self.address} refused this session")
            self.macs = wire.PayloadMacs(key, nonce)
            return ep

        try:
            self.ep = self.runner.run(connect(), timeout=timeout + 5)
        except (AuthenticationError, ConnectionFailed):
            self.runner.stop()
            raise
        except Exception as exc:
            self.runner.stop()
            raise ConnectionFailed(f"UCX endpoint {self.address} unreachable: {exc}") from None

    def put(self, buffers: list[Any], progress: Any = None) -> dict[str, Any]:
        sizes = [memoryview(b).nbytes for b in buffers]
        total = sum(sizes)

        async def go() -> dict[str, Any]:
            await _send_json(self.ep, {"op": "put", "sizes": sizes})
            done, mac = 0, _PayloadMac(self.key, self.macs.label(b"up"))
            for b in buffers:
                for piece in _slices(memoryview(b).cast("B")):
                    mac.add(piece)
                    await self.ep.send(_array(piece))
                    done += len(piece)
                    if progress is not None:
                        progress(done, total)
            await self.ep.send(_array(memoryview(await mac.digest())))
            return await _recv_json(self.ep)

        reply = self.runner.run(go())
        if not reply.get("ok"):
            raise ConnectionError(f"ucx put failed: {reply.get('error')}")
        return {"segment": reply["segment"], "sizes": sizes, "via": "ucx"}

    def get(self, ref: dict[str, Any], progress: Any = None) -> list[Any]:
        sizes = [int(n) for n in ref["sizes"]]
        total = sum(sizes)
        whole = self.spares.take(total, refill=False)

        async def go() -> dict[str, Any]:
            await _send_json(self.ep, {"op": "get", "segment": ref["segment"], "size": total})
            reply = await _recv_json(self.ep)
            if reply.get("ok"):
                done, mac = 0, _PayloadMac(self.key, self.macs.label(b"down"))
                for piece in _slices(whole[:total]):
                    await self.ep.recv(_array(piece))
                    mac.add(piece)
                    done += len(piece)
                    if progress is not None:
                        progress(done, total)
                sent_mac = bytearray(32)
                await self.ep.recv(_array(memoryview(sent_mac)))
                if not hmac.compare_digest(bytes(sent_mac), await mac.digest()):
                    return {"ok": False, "error": "payload failed authentication"}
            return reply

        reply = self.runner.run(go())
        if not reply.get("ok"):
            raise ConnectionError(f"ucx get failed: {reply.get('error')}")
        self.spares.refill(total)
        return split(whole, sizes)

    def ping(self) -> float:
        async def go() -> None:
            await _send_json(self.ep, {"op": "ping"})
            await _recv_json(self.ep)

        start = time.perf_counter()
        self.runner.run(go())
        return time.perf_counter() - start

    def sink(self, nbytes: int) -> float:
        payload = _array(memoryview(bytearray(nbytes)))

        async def go() -> None:
            await _send_json(self.ep, {"op": "sink", "size": nbytes})
            await self.ep.send(payload)
            await _recv_json(self.ep)

        start = time.perf_counter()
        self.runner.run(go())
        return time.perf_counter() - start

    def close(self) -> None:
        self.spares.close()
        try:
            self.runner.run(self.ep.close(), timeout=5)
        except Exception:
            pass
        self.runner.stop()
