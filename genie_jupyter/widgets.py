"""Genie's notebook widgets (anywidget). One front-end module draws any mix of sections:
GPU gauges, health grades, the backend card, the event log, init progress."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anywidget
import traitlets as t


def _asset(name: str) -> str:
    """The front end ships inside the package (static/); an editable install reads js/src/."""
    here = Path(__file__).resolve().parent
    for path in (here / "static" / name, here.parent / "js" / "src" / name):
        if path.exists():
            return path.read_text()
    raise FileNotFoundError(f"genie widget asset {name} is missing from the installation")


class GenieWidget(anywidget.AnyWidget):
    _esm = _asset("widgets.js")
    _css = _asset("widgets.css")

    sections = t.List(t.Unicode()).tag(sync=True)
    status = t.Unicode("live").tag(sync=True)  # "live" or "lost"
    last_seen = t.Float(0.0).tag(sync=True)
    gpus: t.List[dict[str, Any]] = t.List().tag(sync=True)
    cpu_only_reason = t.Unicode("").tag(sync=True)
    history = t.Bytes(b"").tag(sync=True)  # float32 [gpus, metrics, points]: a binary buffer, not JSON
    history_shape = t.List([0, 0, 0]).tag(sync=True)
    history_span = t.Float(0.0).tag(sync=True)  # seconds from the oldest point of the history to the newest
    health = t.Dict().tag(sync=True)
    backend = t.Dict().tag(sync=True)
    events: t.List[dict[str, Any]] = t.List().tag(sync=True)  # newest first, bounded
    event_filter = t.Unicode("").tag(sync=True)
    phases: t.List[dict[str, Any]] = t.List().tag(sync=True)
    summary = t.Unicode("").tag(sync=True)
    jobs: t.List[dict[str, Any]] = t.List().tag(sync=True)  # name, state, elapsed, tail

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """Front ends without widgets (terminal IPython, nbconvert) get a text snapshot."""
        bundle = super()._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        if isinstance(data, dict):
            data["text/plain"] = self.text()
        return bundle

    def text(self) -> str:
        lines = []
        if self.status == "lost":
            lines.append("server lost")
        if "init" in self.sections:
            lines += [f"✓ {p['name']} ({p['seconds'] * 1000:.0f} ms)" for p in self.phases] + (
                [self.summary] if self.summary else []
            )
            if not self.phases and not self.summary:
                lines.append(f"connecting to {self.target}…" if self.target else "connecting…")
        if "health" in self.sections and self.health:
            lines.append(
                f"health {self.health.get('grade')}: "
                + "; ".join(c["reason"] for c in self.health.get("checks", []) if c["grade"] != "HEALTHY")
            )
        if "gauges" in self.sections:
            if not self.gpus:
                lines.append(f"CPU-only server: {self.cpu_only_reason or 'no GPU'}")
            for g in self.gpus:
                util = "unknown" if g.get("utilization") is None else f"{g['utilization']:.0f}%"
                temp = "unknown" if g.get("temperature") is None else f"{g['temperature']:.0f} °C"
                lines.append(f"GPU {g['index']} {g.get('name') or ''}: utilization {util}, temperature {temp}")
        if "backend" in self.sections and self.backend:
            lines.append(f"backend {self.backend.get('chosen')}: {self.backend.get('reason', '')}")
        if "jobs" in self.sections:
            lines += [
                f"{j['name']} {j['state']} {j['elapsed']:.1f} s  {(j['tail'].splitlines() or [''])[-1]}"
                for j in self.jobs
            ]
        if "events" in self.sections:
            lines += [f"{e['type']} {e.get('data', {}).get('message', '')}" for e in self.events[:5]]
        return "\n".join(lines) or type(self).__name__


class GPUGauges(GenieWidget):
    sections = t.List(t.Unicode(), ["gauges"]).tag(sync=True)


class HealthBadge(GenieWidget):
    sections = t.List(t.Unicode(), ["health"]).tag(sync=True)


class BackendCard(GenieWidget):
    sections = t.List(t.Unicode(), ["backend"]).tag(sync=True)


class EventLog(GenieWidget):
    sections = t.List(t.Unicode(), ["events"]).tag(sync=True)


class InitProgress(GenieWidget):
    sections = t.List(t.Unicode(), ["init"]).tag(sync=True)
    target = t.Unicode("")  # where %genie_init connects, for the text form before the first phase


class Dashboard(GenieWidget):
    sections = t.List(t.Unicode(), ["health", "gauges", "backend", "events"]).tag(sync=True)


class PoolDashboard(GenieWidget):
    """The pool: every node (health and its reasons) and every GPU (utilization and memory with
    their history, temperature, power, who holds it), the queue with your place, your sessions'
    GPUs. Fed by genie_jupyter.pool_feed from the pool's own readings."""

    sections = t.List(t.Unicode(), ["pool"]).tag(sync=True)
    pool = t.Dict().tag(sync=True)  # pool_feed.pool_view
    expanded = t.List(t.Unicode()).tag(sync=True)  # node ids the user opened: their history is sent
    controls = t.Dict({"sort": "free", "type": ""}).tag(sync=True)  # sort: free | name | busy; type: a GPU name
    pool_history = t.Bytes(b"").tag(sync=True)  # float32 [rows, 2 (utilization, memory), points]
    pool_history_rows: t.List[list[Any]] = t.List().tag(sync=True)  # [[node id, GPU index], ...], one per row
    pool_history_shape = t.List([0, 2, 0]).tag(sync=True)
    pool_history_span = t.Float(0.0).tag(sync=True)

    def text(self) -> str:
        view = self.pool
        if not view:
            return "pool: no reading yet"
        lines = ["pool lost: its endpoint does not answer" if self.status == "lost" else ""]
        queue = view["queue"]
        lines.append(
            f"pool at {view['address']}: {view['free']} of {view['total']} GPUs free"
            + (f"; queue {queue['length']}" if queue["length"] else "")
            + (f" (you: {', '.join(map(str, queue['yours']))})" if queue["yours"] else "")
        )
        for node in view["nodes"]:
            lines.append(f"{node['name']} {node['grade']}: {node['free']} of {node['gpu_count']} free")
            lines += [f"    ! {reason}" for reason in node["reasons"]]
        lines += [f"you: GPU {m['gpu']} on {m['node']} ({m['session']})" for m in view["mine"]]
        return "\n".join(line for line in lines if line)


class JobsView(GenieWidget):
    """The session's background jobs with their live output tails; it refreshes itself about
    twice a second while any of them runs (from the jobs' own state: no round trip)."""

    sections = t.List(t.Unicode(), ["jobs"]).tag(sync=True)

    def __init__(self, jobs: list[Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._jobs = jobs
        self._refresh()
        threading.Thread(target=self._follow, name="genie-jobs-view", daemon=True).start()

    def _refresh(self) -> None:
        self.jobs = [
            {"name": j.name, "state": j.state, "elapsed": round(j.elapsed, 1), "tail": j.tail(5)} for j in self._jobs
        ]

    def _follow(self) -> None:
        while self.comm is not None and any(not j.done() for j in self._jobs):
            time.sleep(0.5)
            self._refresh()
        self._refresh()
