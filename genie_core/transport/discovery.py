"""Backend discovery: which data-plane backends can work between this client and its server,
how fast each one measures, and which one to use, with the reason in words."""

from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import GenieError
from . import detect
from .base import InlineTransport
from .segment import SHM_DIR, Segment, shm_available

GIB = 1024**3
ORDER = ["shm", "tcp", "zmq", "ucx", "rdma", "dpdk", "gpudirect"]


def rate(bps: float) -> str:
    return f"{bps / GIB:.2f} GiB/s" if bps >= GIB else f"{bps / 1e6:.1f} MB/s"


class BackendUnavailable(GenieError):
    """A backend was asked for by name and cannot be used here."""


@dataclass
class Candidate:
    name: str
    available: bool
    reason: str
    rtt_s: float | None = None
    bandwidth: float | None = None  # bytes per second, measured
    details: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.available:
            return f"{self.name}: unavailable ({self.reason})"
        bw = rate(self.bandwidth) if self.bandwidth else "not measured"
        rtt = f", {self.rtt_s * 1e3:.2f} ms round trip" if self.rtt_s is not None else ""
        return f"{self.name}: {bw}{rtt}"


@dataclass
class BackendReport:
    chosen: str
    reason: str
    candidates: list[Candidate]
    requested: str = "auto"
    elapsed_s: float = 0.0

    def candidate(self, name: str) -> Candidate:
        return next(c for c in self.candidates if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen, "reason": self.reason, "requested": self.requested, "elapsed_s": round(self.elapsed_s, 4),
            "candidates": [asdict(c) for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BackendReport":
        return cls(d["chosen"], d["reason"], [Candidate(**c) for c in d["candidates"]], d.get("requested", "auto"), d.get("elapsed_s", 0.0))


def _median_time(fn: Any, n: int) -> float:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _probe_size(rate_guess: float, budget: float) -> int:
    """A transfer that takes about a quarter of the budget at the guessed rate (64 KiB..64 MiB)."""
    return int(min(64 << 20, max(64 << 10, rate_guess * budget / 4)))


def _measure_stream(transport: Any, budget: float) -> tuple[float, float]:
    """Round trip (median of 10 pings) and bandwidth (a sink sized to the budget) of a socket-like
    backend: a small send guesses the rate, then a transfer of about a quarter of the budget."""
    rtt = _median_time(transport.ping, 10)
    first = 256 << 10
    guess = first / max(transport.sink(first), 1e-6)
    size = min(32 << 20, _probe_size(guess, budget))
    return rtt, size / statistics.median(transport.sink(size) for _ in range(2))


def discover(client: Any, requested: str = "auto", budget: float = 1.0) -> tuple[BackendReport, Any]:
    """Measure the candidates (within `budget` seconds) and open the chosen transport."""
    from .shm import ShmTransport
    from .tcp import TcpTransport

    start = time.perf_counter()
    server = client.node.get("transport") or {}
    server_detect = server.get("detect") or {}
    candidates: list[Candidate] = []
    transports: dict[str, Any] = {"zmq": InlineTransport()}

    # zmq: the control connection itself; always there.
    rtt = _median_time(client.ping, 5)
    small = bytes(256 << 10)
    guess = len(small) / max(_median_time(lambda: client._request(_probe_message(small)).wait(10), 1), 1e-6)
    blob = bytes(min(4 << 20, _probe_size(guess, budget)))
    took = _median_time(lambda: client._request(_probe_message(blob)).wait(10), 2)
    inline = "the control connection (CURVE-encrypted, buffers signed inline)" if server.get("encrypted") else "the control connection (buffers signed inline)"
    candidates.append(Candidate("zmq", True, inline, rtt, len(blob) / took))

    # shm: only if the server's probe file is visible here with the right contents: the same host.
    ok, why = shm_available()
    probe = server.get("shm_probe")
    if ok and probe:
        try:
            content = (SHM_DIR / probe["name"]).read_bytes()
            ok = hashlib.sha256(content).hexdigest() == probe["sha256"]
            why = "" if ok else "the server's shared-memory probe differs here: not the same host"
        except OSError:
            ok, why = False, "the server's shared-memory probe is not visible here: a different host (or /dev/shm, or user)"
    elif ok:
        ok, why = False, "the server offers no shared-memory probe"
    if ok:
        shm = ShmTransport()
        size = min(16 << 20, _probe_size(4e9, budget))
        payload = memoryview(bytearray(size))
        probe_segment = Segment.create("genie-c", size)  # reused, like the tcp probe's buffer: both
        probe_segment.view[:size] = payload               # measure the transport, not fresh pages

        def shm_round() -> None:
            probe_segment.view[:size] = payload
            client._request(_probe_message(b"", {"segment": probe_segment.name, "sizes": [size], "via": "shm", "keep": True})).wait(10)

        try:
            took = _median_time(shm_round, 3)
        finally:
            probe_segment.close()
            probe_segment.unlink()
        transports["shm"] = shm
        candidates.append(Candidate("shm", True, "same host: shared memory", rtt, size / took))
    else:
        candidates.append(Candidate("shm", False, why))

    # tcp: a plain socket to the server's data port.
    port = client.data_port or server.get("data_port")
    encrypted = "off: the server encrypts (--encrypt), and this backend would not; data goes over CURVE-encrypted zmq, or shm on one host"
    if server.get("encrypted"):
        candidates.append(Candidate("tcp", False, encrypted))
    elif not port:
        candidates.append(Candidate("tcp", False, "the server has no data port"))
    else:
        try:
            tcp = TcpTransport(client.host, int(port), client.codec.key, client.session, timeout=min(5.0, budget * 2))
            tcp_rtt, bw = _measure_stream(tcp, budget)
            transports["tcp"] = tcp
            detail = {"port": int(port), "payload_mac": tcp.mac_on}
            candidates.append(Candidate("tcp", True, f"data port {port}" + (", payload HMAC on" if tcp.mac_on else " (loopback: no payload HMAC)"), tcp_rtt, bw, detail))
        except (GenieError, OSError, ConnectionError) as exc:
            candidates.append(Candidate("tcp", False, f"data port {client.host}:{port} not usable: {exc}"))

    # ucx: both ends need the ucxx bindings; the server says so by offering a UCX port. On one host
    # shared memory is faster, so ucx is measured (and ucxx imported: about a second) only when asked.
    ucx_port = server.get("ucx_port")
    ucx_candidate = None
    same_host = any(c.name == "shm" and c.available for c in candidates)
    if server.get("encrypted"):
        candidates.append(Candidate("ucx", False, encrypted))
    elif not ucx_port:
        reason = (server_detect.get("ucx") or {}).get("reason") or "offers no UCX port (no ucxx there, or still starting)"
        candidates.append(Candidate("ucx", False, f"server: {reason}"))
    elif same_host and requested not in ("ucx", "rdma"):
        candidates.append(Candidate("ucx", True, f"UCX port {ucx_port}; not measured: same host, where shm is faster"))
    elif not (local_ucx := detect.ucx())[0]:
        candidates.append(Candidate("ucx", False, f"here: {local_ucx[1]}"))
    else:
        try:
            from .ucx import UcxTransport

            ucx_t = UcxTransport(client.host, int(ucx_port), client.codec.key, client.session, timeout=min(5.0, budget * 4))
            ucx_rtt, bw = _measure_stream(ucx_t, budget)
            transports["ucx"] = ucx_t
            ucx_candidate = Candidate("ucx", True, f"UCX port {ucx_port} ({local_ucx[1]})", ucx_rtt, bw, {"port": int(ucx_port)})
            candidates.append(ucx_candidate)
        except (GenieError, OSError, ConnectionError) as exc:
            candidates.append(Candidate("ucx", False, f"UCX port {client.host}:{ucx_port} not usable: {exc}"))

    # Hardware: both ends must have it. RDMA in practice is UCX over a detected RDMA device.
    for name in ("rdma", "dpdk", "gpudirect"):
        remote = server_detect.get(name) or {"available": False, "reason": "not reported by the server"}
        local = {"rdma": detect.rdma, "dpdk": detect.dpdk, "gpudirect": detect.gpudirect}[name]()
        details = {"local": local[2], "server": remote.get("details", {})}
        if not local[0]:
            candidates.append(Candidate(name, False, f"here: {local[1]}", details=details))
        elif not remote["available"]:
            candidates.append(Candidate(name, False, f"server: {remote['reason']}", details=details))
        elif name == "rdma" and ucx_candidate is not None:
            candidates.append(Candidate("rdma", True, "RDMA devices on both ends, used through UCX", ucx_candidate.rtt_s, ucx_candidate.bandwidth, details))
            transports["rdma"] = transports["ucx"]
        else:
            need = "the ucx backend, which is unavailable" if name == "rdma" else "a data path Genie does not have (it is detected and reported only)"
            candidates.append(Candidate(name, False, f"detected on both ends, but it needs {need}", details=details))

    candidates.sort(key=lambda c: ORDER.index(c.name))
    usable = [c for c in candidates if c.available and c.bandwidth]
    if requested != "auto":
        chosen = next((c for c in candidates if c.name == requested), None)
        if chosen is None or not chosen.available:
            for t in transports.values():
                t.close()
            raise BackendUnavailable(f"backend {requested!r} is unavailable: {chosen.reason if chosen else 'unknown backend'}")
        reason = f"{requested}: forced ({chosen.summary()})"
    else:
        chosen = max(usable, key=lambda c: c.bandwidth)
        others = [c for c in usable if c is not chosen]
        versus = ", ".join(f"{c.name} {rate(c.bandwidth)}" for c in others)
        reason = f"{chosen.name}: {chosen.reason}, {rate(chosen.bandwidth)}" + (f" vs {versus}" if versus else "")
    for t in transports.values():
        if t is not transports[chosen.name]:
            t.close()
    report = BackendReport(chosen.name, reason, candidates, requested, time.perf_counter() - start)
    return report, transports[chosen.name]


def _probe_message(blob: bytes, ref: dict[str, Any] | None = None) -> Any:
    from ..protocol import Message

    return Message("data_probe", {"data": ref}, [blob] if blob else [])
