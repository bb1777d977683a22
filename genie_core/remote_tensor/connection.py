"""Which connection serves `remote_accelerator` tensors, and each device's op stream on it.

genie_core sets the connection (`set_client`, called by `enable`), so this package never imports
the layer above it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from . import forks

DEVICE_TYPE = "remote_accelerator"
_streams: dict[tuple[int, int], Any] = {}


class _Current(threading.local):
    index = 0  # the current device of this thread, as torch.cuda keeps one per thread


_current = _Current()


def current_index() -> int:
    """The device `remote_accelerator` without an index means (torch.remote_accelerator.set_device)."""
    return _current.index


def set_current_index(index: int) -> None:
    _current.index = index


def stream_for(index: int | None) -> Any:
    """The op stream of `remote_accelerator:index` in the current session."""
    from ..errors import NotInitializedError
    from .stream import OpStream

    forks.refuse_in_a_forked_child()
    client = _connected()
    if client is None:
        raise NotInitializedError("using remote_accelerator tensors")
    index = _current.index if index is None else index
    count = device_count()
    if not 0 <= index < count:
        raise RuntimeError(
            f"{DEVICE_TYPE}:{index} does not exist: the server has {count} device(s) ({DEVICE_TYPE}:0..{count - 1})"
        )
    key = (id(client), index)
    stream = _streams.get(key)
    if stream is None or stream.client is not client:
        for old in [k for k, s in _streams.items() if not s.alive]:
            del _streams[old]
        stream = _streams[key] = OpStream(client, index)
    return stream


def _index(device: Any) -> int:
    import torch

    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return _current.index if index is None else index


def device_count() -> int:
    """Remote GPUs of the connected server; a server without GPUs offers its CPU as device 0."""
    client = _connected()
    return 0 if client is None else max(1, len(client.node.get("gpus") or []))


def server_device_type() -> str:
    """What `remote_accelerator` is on the current session's server: "cuda" or "cpu"."""
    from .stream import device_type_of

    return device_type_of(_connected())


_current_client: Callable[[], Any] = lambda: None  # noqa: E731 (genie_core's connection, set by set_client)


def set_client(current_client: Callable[[], Any]) -> None:
    global _current_client
    _current_client = current_client


def _connected() -> Any:
    client = _current_client()
    return client if client is not None and client.connected else None


def _after_fork_in_child() -> None:
    forks.from_a_session = forks.from_a_session or _streams != {} or _current_client() is not None


os.register_at_fork(after_in_child=_after_fork_in_child)


def live_streams() -> list[Any]:
    """The op streams of the current and earlier sessions that are still open."""
    return [s for s in _streams.values() if s.alive]
