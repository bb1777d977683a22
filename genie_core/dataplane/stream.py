"""The exchange on a stream backend (tcp, ucx), both ends, written once and without I/O.

Each side is a generator that yields what to send or receive (`Send`, `Receive`, ...) and is
sent back what was received; a backend only drives it over its own connection, synchronously
(tcp) or with asyncio (ucx), as h11 does for HTTP. The exchange:

    server: GREETING + nonce    client: {"session", "nonce", "proof", "mac"}    server: {"ok", "mac"}
    then, any number of times:
    put   client: {"op": "put", "sizes"} payload      server: {"ok", "segment"} (a segment the worker adopts)
    get   client: {"op": "get", "segment", "size"}    server: {"ok", "size", "trailer"} payload [trailer]
          (a segment a worker staged; with "trailer", one it was still filling: sent as it filled,
          then {"ok", "ename", "evalue"}: whether it filled it all)
    ping  client: {"op": "ping"}                       server: {"ok"}
    sink  client: {"op": "sink", "size"} payload       server: {"ok"} (discovery: received and discarded)

Payloads carry a MAC trailer (wire.PayloadMac) when the connection has MACs on: when either end
asks for them (each asks when its peer is not on loopback), and the server's answer settles it.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..protocol.contents import DataRef, Failure
from ..protocol.errors import error_from
from . import wire
from .filling import Filling, Fillings
from .segment import Segment, segment_spares, split

log = logging.getLogger("genie.data")


@dataclass
class Send:
    """Send raw bytes (the greeting)."""

    data: bytes


@dataclass
class Receive:
    """Receive exactly `size` raw bytes."""

    size: int


@dataclass
class SendHeader:
    header: dict[str, Any]


@dataclass
class ReceiveHeader:
    limit: int = 1 << 20


@dataclass
class SendPayload:
    """Send `buffers`; with a `filling`, each piece once its worker has filled it."""

    buffers: list[Any]
    mac: wire.PayloadMac | None
    progress: wire.Progress = None
    filling: Filling | None = None


@dataclass
class ReceivePayload:
    """Receive into `view`; the driver answers whether the MAC trailer matched (True if none)."""

    view: memoryview
    mac: wire.PayloadMac | None
    progress: wire.Progress = None
    pieces: list[int] = field(default_factory=list)  # buffer sizes, so MAC pieces are cut as the sender cut them


Step = Send | Receive | SendHeader | ReceiveHeader | SendPayload | ReceivePayload
Exchange = Generator[Step, Any, Any]


def cut(buffers: list[Any], size: int) -> Iterator[tuple[memoryview, int]]:
    """Each buffer in pieces of at most `size` bytes (a multiple of the MAC's chunks, so that both
    ends cut a payload's MAC alike), with how many bytes the payload has up to each piece's end."""
    end = 0
    for b in buffers:
        view = memoryview(b).cast("B")
        for start in range(0, len(view), size):
            piece = view[start : start + size]
            end += len(piece)
            yield piece, end


def mac_matches(mac: wire.PayloadMac | None, trailer: bytes) -> bool:
    return mac is None or hmac.compare_digest(trailer, mac.digest())


# -- the server's side ----------------------------------------------------------------------


@dataclass
class DataHost:
    """What a data listener needs from the server: the key, which sessions exist (and their
    workers' pids), who owns the segments filled here, and the largest put it takes."""

    key: bytes
    session_workers: Callable[[str], list[int] | None]
    fillings: Fillings  # staged segments their workers still fill: the worker pool's own (one object)
    owners: dict[str, str] = field(default_factory=dict)  # segment name -> session, shared by all listeners
    max_put: int = 1 << 50


def serve(host: DataHost, mac_on: bool) -> Exchange:
    """One data connection, server side: authenticate it, then answer its requests."""
    nonce = os.urandom(wire.NONCE)
    yield Send(wire.GREETING + nonce)
    hello = yield ReceiveHeader(4096)
    session = str(hello.get("session", ""))
    try:
        proof = bytes.fromhex(str(hello.get("proof", "")))
        nonce += bytes.fromhex(str(hello.get("nonce", "")))  # the client's: both ends make it fresh
    except ValueError:
        proof = b""
    if (
        len(nonce) != 2 * wire.NONCE
        or host.session_workers(session) is None
        or not hmac.compare_digest(proof, wire.handshake_mac(host.key, nonce, session))
    ):
        log.warning("refused a data connection: bad proof or unknown session")
        yield SendHeader({"ok": False, "error": "authentication failed"})
        return
    mac_on = mac_on or bool(hello.get("mac"))
    yield SendHeader({"ok": True, "mac": mac_on})
    macs = wire.PayloadMacs(host.key, nonce, mac_on)
    made: list[Segment] = []  # filled here, not yet adopted by a worker
    spares = segment_spares("genie-s")
    scratch = bytearray(0)
    try:
        while True:
            header = yield ReceiveHeader()
            op = header.get("op")
            if op == "ping":
                yield SendHeader({"ok": True})
            elif op == "put":
                sizes = [int(n) for n in header["sizes"]]
                wire.check_put(sizes, host.max_put)
                for old in [m for m in made if not m.path.exists()]:  # adopted by a worker since
                    made.remove(old)
                    host.owners.pop(old.name, None)
                segment = spares.take(sum(sizes), refill=False)
                made.append(segment)
                try:
                    ok = yield ReceivePayload(segment.view[: sum(sizes)], macs.start(b"up"), pieces=sizes)
                finally:
                    segment.close()
                if not ok:
                    made.remove(segment)
                    segment.unlink()
                    yield SendHeader({"ok": False, "error": "payload failed authentication"})
                    continue
                host.owners[segment.name] = session
                yield SendHeader({"ok": True, "segment": segment.name, "sizes": sizes})
                spares.refill(sum(sizes))
            elif op == "get":
                name = str(header.get("segment", ""))
                filling = host.fillings.take(name, session)
                view = _staged(host, session, name, filling)
                if view is None:
                    why = filling.outcome() if filling is not None else {}  # (its worker has died)
                    yield SendHeader({**why, "ok": False, "error": "no such staged data for this session"})
                    continue
                size = min(int(header["size"]), len(view))
                yield SendHeader({"ok": True, "size": size, "trailer": filling is not None})
                yield SendPayload([view[:size]], macs.start(b"down"), filling=filling)
                del view  # (a mapping kept would keep the memory after its worker lets it go)
                if filling is not None:
                    filling.sent()  # before the client hears: its next fetch may follow
                    yield SendHeader(filling.outcome())
            elif op == "sink":
                n = int(header["size"])
                wire.check_put([n], host.max_put)
                if len(scratch) < n:
                    scratch = bytearray(n)
                ok = yield ReceivePayload(memoryview(scratch)[:n], macs.start(b"up"), pieces=[n])
                yield SendHeader({"ok": ok})
            else:
                yield SendHeader({"ok": False, "error": f"unknown op {op!r}"})
    finally:
        spares.close()
        for segment in made:  # filled but never adopted (the client went away): free them
            host.owners.pop(segment.name, None)
            segment.unlink()


def _staged(host: DataHost, session: str, name: str, filling: Filling | None) -> memoryview | None:
    """A segment one of this session's workers staged for a pull (and nobody else's: one with a
    `filling` is, the server said so). Its name goes as it is mapped, unless its worker fills it
    again once it is sent."""
    parts = name.split("-")
    pids = host.session_workers(session) or []
    if filling is None and (len(parts) < 4 or parts[1] != "w" or not parts[2].isdigit() or int(parts[2]) not in pids):
        return None
    try:
        if filling is not None and filling.reusable:
            return Segment.attach(name).view
        return Segment.adopt(name)  # staged for exactly one pull: gone once sent
    except (OSError, ValueError):
        return None


# -- the client's side ----------------------------------------------------------------------


def authenticate(key: bytes, session: str, want_mac: bool) -> Exchange:
    """Returns the connection's payload MACs, on if either end asked for them."""
    greeting = yield Receive(len(wire.GREETING) + wire.NONCE)
    if not greeting.startswith(wire.GREETING):
        raise ConnectionError("not a genie data port (or another version of it)")
    mine = os.urandom(wire.NONCE)  # so that a server's side recorded earlier cannot be replayed to us
    nonce = greeting[len(wire.GREETING) :] + mine
    proof = wire.handshake_mac(key, nonce, session).hex()
    yield SendHeader({"session": session, "nonce": mine.hex(), "proof": proof, "mac": want_mac})
    reply = yield ReceiveHeader()
    if not reply.get("ok"):
        raise PermissionError("the data port refused this session")
    return wire.PayloadMacs(key, nonce, on=bool(reply.get("mac")) or want_mac)


def put(macs: wire.PayloadMacs, buffers: list[Any], progress: wire.Progress = None) -> Exchange:
    sizes = [memoryview(b).nbytes for b in buffers]
    yield SendHeader({"op": "put", "sizes": sizes})
    yield SendPayload(buffers, macs.start(b"up"), progress)
    reply = yield ReceiveHeader()
    if not reply.get("ok"):
        raise ConnectionError(f"data put failed: {reply.get('error')}")
    return {"segment": reply["segment"], "sizes": sizes}


def get(macs: wire.PayloadMacs, ref: DataRef, into: memoryview, progress: wire.Progress = None) -> Exchange:
    """Fetch a staged segment into `into` (the caller's reused receive buffer); returns its buffers."""
    sizes = [int(n) for n in ref["sizes"]]
    total = sum(sizes)
    yield SendHeader({"op": "get", "segment": ref["segment"], "size": total})
    reply = yield ReceiveHeader()
    if reply.get("ename"):  # what was staged will not come (its worker died)
        raise _failure(reply)
    if not reply.get("ok"):
        raise ConnectionError(f"data get failed: {reply.get('error')}")
    authentic = yield ReceivePayload(into[:total], macs.start(b"down"), progress, pieces=[total])
    # sent while the worker filled it: did it fill it all? (read in any case: the next reply follows it)
    outcome = (yield ReceiveHeader()) if reply.get("trailer") else {"ok": True}
    if not authentic:
        raise ConnectionError("payload failed authentication")
    if not outcome.get("ok"):
        raise _failure(outcome)
    return split(into, sizes)


def _failure(said: dict[str, Any]) -> Exception:
    """The error a data port gave for bytes a worker did not finish staging."""
    failure = Failure(ename=str(said.get("ename") or "ConnectionError"), evalue=str(said.get("evalue", "")))
    return error_from(failure, "the server could not send these bytes: ")


def ping() -> Exchange:
    yield SendHeader({"op": "ping"})
    yield ReceiveHeader()


def sink(macs: wire.PayloadMacs, payload: memoryview) -> Exchange:
    """Send bytes the server receives and discards: how fast this connection moves data."""
    yield SendHeader({"op": "sink", "size": len(payload)})
    yield SendPayload([payload], macs.start(b"up"))
    reply = yield ReceiveHeader()
    if not reply.get("ok"):
        raise ConnectionError("payload failed authentication")
