"""One pool session: a Ray actor holding the GPUs Ray gave it and running a genie server for them.

The actor is detached and named, so it outlives the pool endpoint that made it; its client talks
to its server directly (cells, tensors and the data plane are those of `genie serve`). Ray picks
the node and sets CUDA_VISIBLE_DEVICES; the server offers exactly those GPUs. A warm one (see
warm.py) is started ahead with no session; `claim` gives it one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from typing import Any, cast

from ..config import ClusterConfig
from ..protocol import Message, contents
from ..server import Server

NAMESPACE = "genie-pool"
PREFIX = "s:"  # session actors' names: s:<session id>, or s:<another id> for a warm one (warm.py)


def end_actor(actor: Any) -> None:
    """A session actor ends, warm or held: its server stops first (so it removes its shared-memory
    files; at most a second's wait), then Ray frees its GPUs; one already gone (with its node) is
    no error."""
    import ray

    with contextlib.suppress(Exception):
        ray.get(actor.stop.remote(), timeout=1.0)
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


class SessionActor:
    """Made by the pool with `ray.remote(...)(SessionActor).options(num_gpus=N, ...)`."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import ray

        context = ray.get_runtime_context()
        self.spec = spec
        self.session_id = str(spec.get("session", ""))  # "" until a warm one is claimed
        self.node_id = context.get_node_id()
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        host = spec.get("host") or ray.util.get_node_ip_address()
        simulated = len(self.gpu_ids) if spec.get("simulate_gpus") else None
        config = ClusterConfig.resolve(
            node_role="server",
            ip=host,
            master_port=0,
            token=spec["token"],
            gpus=",".join(g for g in self.gpu_ids if g.isdigit()),  # its workers get CUDA_VISIBLE_DEVICES
            node_id=spec.get("node_name") or None,
            idle_timeout=spec.get("idle_timeout") or None,
            simulate_gpus=simulated,
            enable_ucx=False,
            session_lease=spec.get("session_lease") or None,
            sandbox_hide=context.get_temp_dir(),  # Ray's session folders (sockets, logs): not for cells
            **spec.get("isolation", {}),
        )
        self.started = time.time()
        self.cells: list[dict[str, Any]] = []  # the audit trail, until the pool collects it
        self._cells_lock = threading.Lock()
        self.server = Server(config)
        self.server.requests.on_cell = self._on_cell
        self.server.start().start_in_thread()

    def _on_cell(self, session: Any, msg: Message) -> None:
        """Who ran what, where: the code's hash and size (not the code), time, GPU."""
        cell = cast(contents.Execute, msg.content)
        code = str(cell.get("code", ""))
        gpu = cell.get("gpu")
        record = {
            "time": time.time(),
            "code_sha256": hashlib.sha256(code.encode()).hexdigest(),
            "bytes": len(code.encode()),
            "gpu": str(gpu) if gpu is not None else (self.gpu_ids[0] if self.gpu_ids else ""),
            "job": bool(cell.get("job")),
        }
        with self._cells_lock:
            self.cells.append(record)
            del self.cells[:-10_000]  # bounded if nobody collects

    def take_cells(self) -> list[dict[str, Any]]:
        """The cells run since the last call (the pool writes them to its audit log)."""
        with self._cells_lock:
            taken, self.cells = self.cells, []
        return taken

    def until_claimed(self) -> str:
        """Returns when a warm one is claimed, or says that its server stopped first (the pool
        then ends it and warms another). Its process dying fails the call: the pool sees that too."""
        while not self.session_id:
            if self.server.wait_stopped(0.5):
                return "its server stopped"
        return "claimed"

    def claim(self, session_id: str, spec: dict[str, Any]) -> dict[str, Any]:
        """A warm one becomes `session_id`'s, with the pool's settings of now; its client's time to
        connect starts now."""
        settings = ClusterConfig.resolve(
            idle_timeout=spec.get("idle_timeout") or None, session_lease=spec.get("session_lease") or None
        )
        self.server.config.idle_timeout = settings.idle_timeout  # the server reads both as it checks
        self.server.config.session_lease = settings.session_lease
        self.spec = {**self.spec, **spec, "token": self.spec["token"]}
        self.session_id, self.started = session_id, time.time()
        return self.info()

    def info(self) -> dict[str, Any]:
        """Where the session's client connects, and what it holds."""
        return {
            "session": self.session_id,
            "host": self.server.config.ip,
            "port": self.server.port,
            "node_id": self.node_id,
            "gpu_ids": self.gpu_ids,
            "gpus": [g.name if g.name is not None else "GPU" for g in self.server.gpus]
            or ["simulated GPU"] * len(self.gpu_ids),
            "started": self.started,
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # as Ray set it for this actor
            "sessions": len(self.server.sessions.live),
        }

    def wait_ended(self) -> str:
        """Returns why the session is over: its client ended it (or it was culled for idleness), its
        client never came within `connect_within` seconds, or the server was stopped. The actor
        then exits, and Ray frees its GPUs."""
        deadline = self.started + float(self.spec.get("connect_within", 60.0))
        seen = False
        while not self.server.wait_stopped(0):
            live = len(self.server.sessions.live)
            seen = seen or live > 0 or bool(self.server.sessions.ended)  # one may have come and gone between looks
            if seen and live == 0:
                last = next(reversed(self.server.sessions.ended.values()), None)
                reason = f"its session ended: {getattr(last, 'end_reason', '') or 'closed'}"
                break
            if not seen and time.time() > deadline:
                reason = "no client connected in time"
                break
            self.server.wait_stopped(0.2)
        else:
            reason = "the server stopped"
        self.server.stop()
        return reason

    def stop(self) -> None:
        self.server.stop()
