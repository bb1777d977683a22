"""Terminal views of a node: `genie status` prints one report, `genie top` refreshes it live."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .client import Client
from .config import ClusterConfig, ConnectionInfo, runtime_dir
from .errors import ConfigError
from .events import EventType
from .protocol.contents import InfoReply

GIB = 1024**3
GRADE_STYLE = {
    "HEALTHY": "bold green",
    "DEGRADED": "bold yellow",
    "UNHEALTHY": "bold red",
    "CRITICAL": "bold white on red",
}
SEVERITY_STYLE = {"info": "cyan", "warning": "yellow", "error": "red", "critical": "bold red"}
SPARK = "▁▂▃▄▅▆▇█"


def connect(address: str | None, token: str | None, connection_file: str | None, timeout: float = 10.0) -> Client:
    """A short-lived probe connection to the server named, or to the newest local one."""
    from .cluster import resolve_server

    if address is None and connection_file is None:
        local = ConnectionInfo.all_local()
        if not local:
            raise ConfigError(f"no running genie server found on this machine (looked in {runtime_dir()}); pass ADDR")
        _, info = local[-1]
        host, port, token, curve = info.ip, info.port, token or info.token, info.curve
    else:
        config = ClusterConfig.resolve(
            master_addr=address, token=token, connection_file=connection_file, timeout=timeout
        )
        host, port, token, curve = resolve_server(config)
    return Client(host, port, token, timeout=timeout, enable_heartbeat=False, purpose="probe", curve=curve).connect()


def _num(value: Any, fmt: str, unit: str = "") -> str:
    return "unknown" if value is None else f"{value:{fmt}}{unit}"


def spark(points: list[list[float]] | list[tuple[float, float]], width: int = 24, top: float | None = None) -> str:
    values = [v for _, v in points][-width:]
    if not values:
        return ""
    high = top or max(values) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(len(SPARK) * v / high))] if v > 0 else " " for v in values)


def gpu_processes(gpus: list[dict[str, Any]]) -> list[str]:
    """Who holds each GPU: a line per process, named by its session when it is a session's."""
    lines = []
    for g in gpus:
        for p in g.get("processes") or []:
            if p.get("session"):
                who = f"session {p['session']}" + (f" {p['name']!r}" if p.get("name") else "")
                who += f" ({p.get('user') or '?'}@{p.get('host') or '?'})"
            else:
                who = "not a genie session"
            mem = "unknown" if p.get("memory_used") is None else f"{p['memory_used'] / GIB:.2f} GiB"
            sm = "" if p.get("sm_util") is None else f", SM {p['sm_util']:.0f}%"
            lines.append(f"  GPU {g['index']}  pid {p['pid']:<8} {mem}{sm}  {who}")
    return lines


def render(info: InfoReply) -> Group:
    node, metrics, health = info["node"], info.get("metrics") or {}, info.get("health")
    history = info.get("history") or {}
    up = time.time() - node.get("started", time.time())
    title = Text.assemble(
        ("genie server ", "bold"),
        (node["address"], "bold cyan"),
        f" · node {node['node_id']} · up {int(up // 3600)}h {int(up % 3600 // 60)}m {int(up % 60)}s"
        f" · genie {node['version']} (protocol {node['protocol']})",
    )
    parts: list[Any] = [title]

    if health:
        grade = health["grade"]
        table = Table.grid(padding=(0, 1))
        table.add_row(Text("health", style="bold"), Text(grade, style=GRADE_STYLE.get(grade, "")))
        for check in health["checks"]:
            mark = "✓" if check["grade"] == "HEALTHY" else "!"
            table.add_row(
                "",
                Text(
                    f"{mark} {check['reason']}",
                    style="" if check["grade"] == "HEALTHY" else GRADE_STYLE[check["grade"]],
                ),
            )
        parts.append(table)
    elif not info.get("monitoring", {}).get("enabled", True):
        parts.append(Text("health    unknown: monitoring is off on this server"))

    if metrics:
        mem_used = (
            (metrics["memory_total"] - metrics["memory_available"]) / GIB if metrics.get("memory_total") else None
        )
        host = (
            f"host      CPU {_num(metrics.get('cpu_percent'), '.0f', '%')} of {metrics.get('cpu_count')} cores "
            f"{spark(history.get('cpu_percent', []), top=100)}"
            f"  · load {' '.join(map(str, metrics.get('load_avg') or [])) or 'unknown'}"
            f" · memory {_num(mem_used, '.1f')}/{_num((metrics.get('memory_total') or 0) / GIB, '.1f')} GiB"
            f" · disk {_num((metrics.get('disk_free') or 0) / GIB, '.0f')} GiB free"
        )
        parts.append(Text(host))
        gpus = metrics.get("gpus") or []
        if not gpus:
            parts.append(Text(f"GPUs      none: {metrics.get('gpu_reason') or 'no GPU'}"))
        else:
            label = "GPUs" + ("  (SIMULATED: not real readings)" if metrics.get("gpu_source") == "simulated" else "")
            table = Table(title=label, title_justify="left", expand=False, show_edge=False)
            for col in ("GPU", "name", "util", "", "memory", "temp", "power", "state"):
                table.add_column(col)
            for g in gpus:
                if g.get("lost"):
                    table.add_row(
                        str(g["index"]), g.get("name") or "", "", "", "", "", "", Text("LOST", style="bold red")
                    )
                    continue
                mem = (
                    f"{_num((g.get('memory_used') or 0) / GIB, '.1f')}"
                    f"/{_num((g.get('memory_total') or 0) / GIB, '.1f')} GiB"
                    if g.get("memory_total")
                    else "unknown"
                )
                power = f"{_num(g.get('power_draw'), '.0f')}/{_num(g.get('power_limit'), '.0f')} W"
                throttled = ", ".join(r for r in (g.get("throttle_reasons") or []) if r != "gpu_idle") or "ok"
                table.add_row(
                    str(g["index"]),
                    g.get("name") or "unknown",
                    _num(g.get("utilization"), ".0f", "%"),
                    spark(history.get(f"gpu{g['index']}.utilization", []), top=100),
                    mem,
                    _num(g.get("temperature"), ".0f", " °C"),
                    power,
                    throttled,
                )
            parts.append(table)
            parts += [Text(line) for line in gpu_processes(gpus)]

    sessions = info.get("sessions") or []
    visible = [s for s in sessions if s["client"].get("purpose") != "probe"]
    transport = node.get("transport") or {}
    offered = (
        ["zmq"]
        + ([f"tcp (port {transport['data_port']})"] if transport.get("data_port") else [])
        + (["shm"] if transport.get("shm_probe") else [])
    )
    hardware = ", ".join(
        f"{k}: {v['reason']}" for k, v in (transport.get("detect") or {}).items() if isinstance(v, dict)
    )
    parts.append(Text(f"data plane offers {', '.join(offered)}" + (f"  ({hardware})" if hardware else "")))
    limits = node.get("limits")
    tensors, held = (limits.get("session_tensors"), limits.get("session_bytes")) if limits else (None, None)
    per_session = f"{tensors:,} remote tensors" if tensors else "no tensor limit"
    per_session += f", {held / GIB:.1f} GiB" if held else ", no byte limit"
    parts.append(
        Text(
            f"security  {'encrypted (CurveZMQ) and signed' if node.get('encrypted') else 'signed, not encrypted'}"
            f" · per session: {per_session}"
        )
    )
    parts.append(Text(f"sessions  {len(visible)}"))
    for s in visible:
        workers = (
            ", ".join(
                f"pid {w['pid']} {'gpu ' + str(w['slot']) if w['slot'] >= 0 else 'cpu'}{' busy' if w['busy'] else ''}"
                for w in s["workers"]
            )
            or "no worker yet"
        )
        parts.append(
            Text(
                f"  {s['id']}  {s['client'].get('user', '')}@{s['client'].get('host', '?')}"
                f" (pid {s['client'].get('pid', '?')})  "
                f"backend {s.get('backend', '?')}  idle {s['idle_s']:.1f} s  {workers}"
            )
        )

    events = [e for e in info.get("events") or [] if e["type"] != EventType.METRICS.value][-8:]
    if events:
        parts.append(Text("events", style="bold"))
        for e in reversed(events):
            stamp = time.strftime("%H:%M:%S", time.localtime(e["time"]))
            parts.append(
                Text.assemble(
                    f"  {stamp} ",
                    (f"{e['severity']:<8}", SEVERITY_STYLE.get(e["severity"], "")),
                    f" {e['type']:<16} {e['data'].get('message', '')}",
                )
            )
    return Group(*parts)


def console() -> Console:
    """The terminal's width when there is one; piped (`| less`, a log) there is none, and lines are
    never wrapped (rich would wrap at 80 columns and break words)."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=4096, soft_wrap=True, color_system=None)


def status(address: str | None, token: str | None, connection_file: str | None, as_json: bool) -> int:
    client = connect(address, token, connection_file)
    try:
        info = client.info()
    finally:
        client.close()
    if as_json:
        json.dump(info, sys.stdout, indent=1, default=str)
        print()
    else:
        console().print(render(info))
    return 0


def top(address: str | None, token: str | None, connection_file: str | None, iterations: int | None = None) -> int:
    """Redraw on every metric snapshot the server pushes (its poll rate, about 1 Hz)."""
    from rich.live import Live

    client = connect(address, token, connection_file)
    wake = threading.Event()
    client.events.subscribe(lambda e: wake.set(), types=[EventType.METRICS])
    console = Console()
    shown = 0
    try:
        with Live(render(client.info()), console=console, auto_refresh=False, screen=False) as live:
            while iterations is None or shown < iterations:
                if not wake.wait(5.0):
                    live.update(Text(f"no update from {client.address} for 5 s", style="bold red"), refresh=True)
                    continue
                wake.clear()
                live.update(render(client.info()), refresh=True)
                shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return 0
