"""The client's ordered record of ops for one remote device, sent in one message whenever a
value is needed: one round trip per materialization, however many ops were recorded."""

from __future__ import annotations

import itertools
import pickle
import threading
from typing import Any

from ..errors import ConnectionLost, LimitExceeded, RemoteError
from ..serialize import deserialize_namespace

_ids = itertools.count(1)
_BLOCK = 1 << 20
_blocks = itertools.count(1 << 44, _BLOCK)  # far above any single id


def new_id() -> int:
    return next(_ids)


def new_ids() -> range:
    """A block of ids for the outputs of an op that returns a list of unknown length."""
    start = next(_blocks)
    return range(start, start + _BLOCK)


class OpStream:
    def __init__(self, client: Any, index: int) -> None:
        self.client = client
        self.index = index  # remote_accelerator:index, the worker of GPU `index`
        self._records: list[tuple] = []
        self._lock = threading.Lock()
        self.round_trips = 0
        self.ops_sent = 0
        self.server_tensors = 0  # tensors the server held after the last flush
        self.device_kind = "cuda" if (getattr(client, "node", None) or {}).get("gpus") else "cpu"
        self.imported: set[str] = set()  # modules defining custom ops, imported on the server

    @property
    def alive(self) -> bool:
        return not self.client._closed

    def record(self, entry: tuple) -> None:
        with self._lock:
            self._records.append(entry)

    def free(self, rid: int) -> None:
        """Called when a remote tensor is garbage-collected here (any thread)."""
        if self.alive:
            with self._lock:
                self._records.append(("free", rid))

    def pending(self) -> int:
        return len(self._records)

    def flush(self, fetch: list[int] | None = None, *, eager: bool = False, sync: bool = False) -> dict[str, Any]:
        """Send what was recorded (and fetch these ids); raise the first remote failure."""
        if not self.alive:
            raise ConnectionLost("this remote tensor belongs to a Genie session that has ended; run %genie_init and make it again")
        with self._lock:
            records, self._records = self._records, []
        request = {"ops": records, "fetch": list(fetch or []), "eager_last": eager, "sync": sync}
        oob: list[Any] = []
        payload = pickle.dumps(request, protocol=5, buffer_callback=oob.append)
        from ..protocol import Message

        reply = self.client._request(Message("tensor_ops", {"gpu": self.index, "n": len(records)}, [payload, *(b.raw() for b in oob)])).wait()
        self.round_trips += 1
        self.ops_sent += len(records)
        content = reply.content
        self.server_tensors = int(content.get("stored", 0))
        if content.get("status") == "error" and content.get("ename") == "LimitExceeded":
            raise LimitExceeded(str(content.get("evalue")))
        if content.get("status") != "ok":
            raise RemoteError(
                content.get("ename", "Error"),
                f"remote op {content.get('op')} (op {content.get('index', 0) + 1} of {len(records)} sent) failed: {content.get('evalue')}",
            )
        if content.get("fetch"):
            content["values"] = deserialize_namespace(content["fetch"], reply.buffers, allow_pickle=False)  # tensors and numbers only
        return content

    def fetch(self, rid: int) -> Any:
        return self.flush([rid])["values"][str(rid)]
