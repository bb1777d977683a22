"""Is there RDMA, DPDK or GPUDirect here? Each answer is (available, reason, details), and each is a
backend that reports it.

The sysfs and procfs roots are parameters, so tests can point them at fixture trees: the
fake lives at the hardware edge only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .base import Backend, Candidate, Channel, Found, Link, ServerSide

Finding = tuple[bool, str, dict[str, Any]]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def rdma(sys_root: str = "/sys") -> Finding:
    """RDMA devices, their ports, state and link layer, from /sys/class/infiniband."""
    base = Path(sys_root) / "class" / "infiniband"
    if not base.is_dir():
        return False, "no /sys/class/infiniband devices (no RDMA driver loaded)", {}
    devices: list[dict[str, Any]] = []
    for dev in sorted(base.iterdir()):
        ports: list[dict[str, str]] = []
        for port in sorted((dev / "ports").glob("*")):
            ports.append(
                {
                    "port": port.name,
                    "state": _read(port / "state"),  # e.g. "4: ACTIVE"
                    "link_layer": _read(port / "link_layer"),  # InfiniBand or Ethernet (RoCE)
                    "rate": _read(port / "rate"),
                }
            )
        devices.append({"name": dev.name, "ports": ports})
    active = [d for d in devices if any("ACTIVE" in p["state"] for p in d["ports"])]
    if not devices:
        return False, "/sys/class/infiniband is empty", {"devices": []}
    if not active:
        return False, f"RDMA devices {', '.join(d['name'] for d in devices)} have no ACTIVE port", {"devices": devices}
    try:
        import pyverbs  # noqa: F401

        verbs = True
    except ImportError:
        verbs = False
    return (
        True,
        f"RDMA device(s) {', '.join(d['name'] for d in active)} with an ACTIVE port",
        {"devices": devices, "pyverbs": verbs},
    )


def dpdk(sys_root: str = "/sys", proc_root: str = "/proc") -> Finding:
    """DPDK needs its library, hugepages, and NICs bound to vfio-pci or a uio driver."""
    details: dict[str, Any] = {}
    lib = False
    if shutil.which("pkg-config"):
        lib = subprocess.run(["pkg-config", "--exists", "libdpdk"], capture_output=True).returncode == 0
    details["libdpdk"] = lib
    meminfo = _read(Path(proc_root) / "meminfo")
    huge = 0
    for line in meminfo.splitlines():
        if line.startswith("HugePages_Total:"):
            huge = int(line.split()[1])
    details["hugepages"] = huge
    bound = []
    for driver in ("vfio-pci", "uio_pci_generic", "igb_uio"):
        d = Path(sys_root) / "bus" / "pci" / "drivers" / driver
        if d.is_dir():
            bound += [f"{p.name} ({driver})" for p in d.iterdir() if p.name.count(":") == 2]
    details["bound_nics"] = bound
    missing = [
        what
        for what, ok in (
            ("libdpdk (pkg-config)", lib),
            ("hugepages", huge > 0),
            ("NICs bound to vfio-pci/uio", bool(bound)),
        )
        if not ok
    ]
    if missing:
        return False, "no " + ", no ".join(missing), details
    return True, f"libdpdk, {huge} hugepages, {len(bound)} bound NIC(s)", details


def gpudirect(proc_root: str = "/proc") -> Finding:
    """GPUDirect RDMA needs the nvidia_peermem kernel module."""
    modules = _read(Path(proc_root) / "modules")
    loaded = any(line.split()[0] in ("nvidia_peermem", "nv_peer_mem") for line in modules.splitlines() if line)
    if loaded:
        return True, "nvidia_peermem is loaded", {}
    return False, "the nvidia_peermem kernel module is not loaded", {}


class _Detected(Backend):
    """A transport found in the hardware of both ends. `rdma` is used through the ucx backend;
    `dpdk` and `gpudirect` are detected and reported only: Genie has no data path of its own."""

    slow_start = True  # pkg-config and sysfs walks: after the server is ready

    def find(self) -> Finding:
        raise NotImplementedError

    def offer(self, side: ServerSide) -> dict[str, Any]:
        ok, reason, details = self.find()
        return {
            "detect": {
                self.name: {"available": ok, "reason": reason, "details": details},
                "hostname": os.uname().nodename,
            }
        }

    def probe(self, link: Link, budget: float, found: Found) -> tuple[Candidate, Channel | None]:
        remote = (link.server.get("detect") or {}).get(self.name) or {
            "available": False,
            "reason": "not reported by the server",
        }
        ok, reason, local = self.find()
        details = {"local": local, "server": remote.get("details", {})}
        if not ok:
            return Candidate(self.name, False, f"here: {reason}", details=details), None
        if not remote["available"]:
            return Candidate(self.name, False, f"server: {remote['reason']}", details=details), None
        return self.both(details, found)

    def both(self, details: dict[str, Any], found: Found) -> tuple[Candidate, Channel | None]:
        need = "a data path Genie does not have (it is detected and reported only)"
        return Candidate(self.name, False, f"detected on both ends, but it needs {need}", details=details), None


class Rdma(_Detected):
    name = "rdma"
    rival, margin = "tcp", 2.0  # (it is measured as ucx is, by ucx's probe: see Ucx)

    def find(self) -> Finding:
        return rdma()

    def both(self, details: dict[str, Any], found: Found) -> tuple[Candidate, Channel | None]:
        ucx, channel = found.get("ucx", (None, None))
        if ucx is None or channel is None:
            return Candidate(
                self.name,
                False,
                "detected on both ends, but it needs the ucx backend, which is unavailable",
                details=details,
            ), None
        return Candidate(
            self.name, True, "RDMA devices on both ends, used through UCX", ucx.rtt_s, ucx.bandwidth, details
        ), channel


class Dpdk(_Detected):
    name = "dpdk"

    def find(self) -> Finding:
        return dpdk()


class GpuDirect(_Detected):
    name = "gpudirect"

    def find(self) -> Finding:
        return gpudirect()
