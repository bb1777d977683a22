"""Pushes and pulls: values serialized (tensors and arrays as raw bytes), the bytes moved by the
data-plane channel that discovery chose, and a broken data connection said plainly."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

from ..dataplane import DATA_THRESHOLD, BackendReport, Channel, InlineChannel, Link, backends, discover
from ..errors import ConnectionLost, GenieError, MemoryLimitExceeded, size_text
from ..protocol import Message, MessageType, contents, error_from
from ..serialize import deserialize_namespace, serialize_namespace
from .connection import Connection

T = MessageType
R = TypeVar("R")
S = TypeVar("S", bound=contents.Staged)


class Transfers:
    def __init__(self, connection: Connection, data_port: int | None = None) -> None:
        self.connection = connection
        self.data_port = data_port  # a tcp data port given by the user (tunnels, relays), else the server's
        self.channel: Channel = InlineChannel()
        self.report: BackendReport | None = None
        self._lock = threading.Lock()  # one transfer at a time on the data plane

    def select(self, requested: str = "auto", budget: float = 1.0) -> BackendReport:
        """Measure the data-plane backends to this server and use the best (or the one asked for)."""
        c = self.connection

        def data_probe(ref: contents.DataRef | None, blob: bytes) -> None:
            c.request(Message(T.DATA_PROBE, contents.DataProbe(data=ref), [blob] if blob else [])).wait(10)

        def ping() -> None:
            c.request(Message(T.PING)).wait(10)

        link = Link(
            c.host,
            c.codec.key or b"",
            c.session,
            c.node.get("transport") or {},
            self.data_port,
            data_probe,
            ping,
            requested,
        )
        report, channel = discover(backends(), link, budget)
        with self._lock:
            self.channel.close()
            self.channel, self.report = channel, report
        c.request(Message(T.SET_BACKEND, contents.SetBackend(backend=report.chosen))).wait(5)
        return report

    def push(
        self,
        values: dict[str, Any],
        *,
        gpu: int | None = None,
        device: str | None = None,
        timeout: float | None = None,
        progress: Any = None,
    ) -> list[str]:
        metas, buffers = serialize_namespace(values)
        self.refuse_over_limit(sum(memoryview(b).nbytes for b in buffers), "this push")
        content = contents.Push(values=metas, gpu=gpu, device=device)
        reply = cast(contents.PushReply, self.send(T.PUSH, content, buffers, progress=progress, timeout=timeout))
        return list(reply.get("names", []))

    def pull(
        self, names: list[str], *, gpu: int | None = None, timeout: float | None = None, progress: Any = None
    ) -> dict[str, Any]:
        def values(reply: contents.PullReply, buffers: list[Any]) -> dict[str, Any]:
            return deserialize_namespace(reply["values"], buffers)

        return self.fetch(T.PULL, contents.Pull(names=list(names), gpu=gpu), values, progress, timeout)

    def send(
        self,
        kind: MessageType,
        content: Mapping[str, Any],
        buffers: list[Any],
        *,
        progress: Any = None,
        timeout: Any = None,
    ) -> contents.Reply:
        """A request whose buffers go over the data plane (inline when small); its reply's content."""
        size = sum(memoryview(b).nbytes for b in buffers)
        with self._lock:  # the reply frees the channel's buffer for the next transfer
            ref = None
            if size >= DATA_THRESHOLD:
                with self._data_errors(str(kind)):
                    ref = self.channel.put(buffers, progress)
            if ref is not None:
                content, buffers = {**content, "data": ref}, []
            try:
                reply = self.connection.request(Message(kind, content, buffers)).wait(timeout)
            except BaseException:
                if ref is not None:
                    self.channel.discard(ref)  # nobody adopted it
                raise
            finally:
                if ref is not None:
                    self.channel.after()
        answer = cast(contents.Reply, reply.content)
        if answer.get("status") != "ok":
            raise error_from(answer)
        return answer

    def request(
        self,
        kind: MessageType,
        content: Mapping[str, Any],
        head: list[Any],
        buffers: list[Any],
        *,
        lent_to: int | None = None,
    ) -> Any:
        """A request not waited for here (remote tensors' op batches): its `buffers`, after the `head`
        frames, go over the data plane when big, ahead of it, so that they are there when the worker
        reads it. `lent_to`: the worker (GPU index) copies them out, so their memory on the data plane
        may be filled again once the request is answered (Channel.put_lent). Returns the pending request."""
        ref = None
        try:
            if self.goes_by_data_plane(sum(memoryview(b).nbytes for b in buffers)):
                with self._lock, self._data_errors(str(kind)):
                    if lent_to is not None:
                        ref = self.channel.put_lent(buffers, lent_to)
                    else:
                        ref = self.channel.put(buffers)
                        self.channel.after()  # (shared memory: the next segment of that size, faulted in meanwhile)
            if ref is None:
                return self.connection.request(Message(kind, content, [*head, *buffers]))
            request = self.connection.request(Message(kind, {**content, "data": ref}, head))
            with self._lock:
                self.channel.lent_to(ref, request)
        except BaseException:
            if ref is not None:
                with self._lock:
                    self.channel.discard(ref)  # nobody will adopt it (a lent one already lent goes by its answer)
            raise
        request.data = ref
        return request

    def failed(self, request: Any) -> None:
        """A request sent with `request` failed (or its connection did): free what its bytes left
        on the data plane, if nobody adopted it."""
        if request.data is not None:
            with self._lock:
                self.channel.discard(request.data)
            request.data = None

    def goes_by_data_plane(self, size: int) -> bool:
        """Whether a transfer of `size` bytes would take the data plane (else it goes inline)."""
        return size >= DATA_THRESHOLD and self.channel.staged

    def receive(self, ref: contents.DataRef, what: str) -> list[Any]:
        """The buffers a worker staged for a reply (a request's `staged` said this client fetches them)."""
        with self._lock, self._data_errors(what):
            return self.channel.get(ref)

    def refuse_over_limit(self, size: int, what: str) -> None:
        """More bytes than the server lets a session hold: said before a byte is sent."""
        limits = self.connection.node.get("limits")
        limit = limits.get("session_bytes") if limits else None
        if limit is not None and size > limit:
            raise MemoryLimitExceeded(
                f"{what} of {size_text(size)} is more than the server lets a session hold "
                f"({size_text(limit)}, --max-session-bytes)"
            )

    def fetch(
        self,
        kind: MessageType,
        content: Mapping[str, Any],
        consume: Callable[[S, list[Any]], R],
        progress: Any = None,
        timeout: float | None = None,
    ) -> R:
        """A request whose reply's bytes come over the data plane (staged by the worker, or inline);
        `consume(reply content, buffers)` runs while the channel's receive buffer is ours."""
        with self._lock:
            asked = {**content, "staged": self.channel.staged, "streamed": self.channel.streams}
            reply = self.connection.request(Message(kind, asked)).wait(timeout)
            answer = cast(contents.Staged, reply.content)
            if answer.get("status") != "ok":
                raise error_from(answer)
            ref = answer.get("data")
            if ref:
                with self._data_errors(str(kind)):
                    buffers = self.channel.get(ref, progress)
            else:
                buffers = reply.buffers
            return consume(cast(S, answer), buffers)

    @contextlib.contextmanager
    def _data_errors(self, what: str) -> Iterator[None]:
        """A data connection that breaks is a lost connection, said plainly (whatever the backend raised)."""
        try:
            yield
        except GenieError:
            raise
        except Exception as exc:
            raise ConnectionLost(
                f"the {self.channel.name} data connection to genie server at {self.connection.address} broke during a "
                f"{what} ({type(exc).__name__}: {exc}); run %genie_init (or genie_core.init) to reconnect"
            ) from None

    def close(self) -> None:
        self.channel.close()
