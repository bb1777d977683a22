"""`torch.remote_accelerator`: the part of `torch.cuda` that PyTorch's own device-generic code asks
a device module for (`torch.utils.checkpoint`, `torch.random.fork_rng`, `torch.amp`, data loading,
`torch._utils._get_device_module` users), answered by the server's device.

docs/CONFORMANCE.md lists what is here and what is refused. Each answer that needs the server is
one round trip; the rest are recorded with the ops and run in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import captured, server_files
from .connection import DEVICE_TYPE, _connected, _index, current_index, device_count, set_current_index, stream_for


def _ask(index: int, question: str, *args: Any) -> Any:
    """What the server's device says (memory, properties, timing): one round trip."""
    return stream_for(index).answer(("ask", question, args))["value"]


@dataclass(frozen=True)
class DeviceProperties:
    """`get_device_properties`: the server's GPU (or, for a server without one, its CPU as device 0)."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    uuid: str
    bf16_supported: bool


class device:
    """Context manager that makes `remote_accelerator:N` the current device, as `torch.cuda.device`
    does (a negative index or None changes nothing)."""

    def __init__(self, device: Any) -> None:
        self.idx = -1 if device is None or (isinstance(device, int) and device < 0) else _index(device)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = current_index()
        if self.idx >= 0:
            set_device(self.idx)

    def __exit__(self, *exc: Any) -> None:
        set_current_index(self.prev)


class device_of(device):
    """The device of a tensor as the current device (a CPU tensor changes nothing)."""

    def __init__(self, obj: Any) -> None:
        super().__init__(obj.get_device() if obj.device.type == DEVICE_TYPE else None)


def set_device(device: Any) -> None:
    index = _index(device)
    count = device_count()
    if not 0 <= index < max(count, 1):
        raise RuntimeError(f"{DEVICE_TYPE}:{index} does not exist: the server has {count} device(s)")
    set_current_index(index)


class Stream:
    """A device's stream. Each device has one ordered stream on the server, so every `Stream` is
    it: work on two streams already runs in order, `wait_stream` and `wait_event` need nothing,
    and `synchronize()` waits for everything recorded so far (one round trip)."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        import torch

        self.device = torch.device(DEVICE_TYPE, _index(device) if device is not None else current_index())
        self.priority = priority

    def synchronize(self) -> None:
        stream_for(self.device.index).flush(sync=True)

    def query(self) -> bool:
        """Whether all work recorded on the device has finished (without waiting for it)."""
        return stream_for(self.device.index).idle()

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.device == self.device

    def __hash__(self) -> int:
        return hash((DEVICE_TYPE, self.device.index))

    def __repr__(self) -> str:
        return f"<torch.remote_accelerator.Stream device={self.device}>"


class Event:
    """A point in a device's stream. With `enable_timing`, the server's clock (a CUDA event on a GPU
    server) is read when the device reaches it, so `elapsed_time` is the device's time between two."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._where: tuple[Any, int] | None = None  # (stream, the server's clock reading id)

    def record(self, stream: Stream | None = None) -> None:
        from .stream import new_id

        ops = stream_for(stream.device.index if stream is not None else None)
        if self.enable_timing:
            rid = new_id()
            ops.record(("clock", rid))
            self._where = (ops, rid)
        else:
            self._where = (ops, 0)

    def synchronize(self) -> None:
        if self._where is not None:
            self._where[0].flush(sync=True)

    def query(self) -> bool:
        return self._where is None or self._where[0].idle()

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds on the device from this event to `end_event` (both recorded with timing)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        if self._where is None or end_event._where is None:
            raise RuntimeError("elapsed_time needs both events recorded first")
        ops = self._where[0]
        return float(_ask(ops.index, "elapsed", self._where[1], end_event._where[1]))

    def __del__(self) -> None:
        where = getattr(self, "_where", None)
        if where is not None and where[1] and where[0].alive:
            with contextlib.suppress(Exception):
                where[0].free(where[1])


def current_stream(device: Any = None) -> Stream:
    return Stream(device)


default_stream = current_stream


def set_stream(stream: Stream) -> None:
    set_device(stream.device)


@contextlib.contextmanager
def stream(stream: Stream | None) -> Iterator[None]:
    """`with torch.remote_accelerator.stream(s)`: the stream's device is current inside."""
    if stream is None:
        yield
        return
    with device(stream.device):
        yield


Properties = DeviceProperties  # (inside _DeviceModule the name DeviceProperties is its attribute, no type)


class _DeviceModule:
    """`torch.remote_accelerator`: what `torch.cuda` offers, for the remote devices."""

    CUDAGraph = captured.CUDAGraph
    load = staticmethod(server_files.load)  # a checkpoint on the server's disk, loaded there
    from_pretrained = staticmethod(server_files.from_pretrained)
    graph = captured.graph
    make_graphed_callables = staticmethod(captured.make_graphed_callables)
    graph_pool_handle = staticmethod(captured.graph_pool_handle)
    is_current_stream_capturing = staticmethod(captured.is_current_stream_capturing)
    device = device
    device_of = device_of
    Stream = Stream
    Event = Event
    DeviceProperties = DeviceProperties  # (inside _DeviceModule the name DeviceProperties is its attribute, no type)
    current_stream = staticmethod(current_stream)
    default_stream = staticmethod(default_stream)
    set_stream = staticmethod(set_stream)
    stream = staticmethod(stream)
    set_device = staticmethod(set_device)

    @property
    def _initialized(self) -> bool:
        """Whether a session serves the device: torch.utils.checkpoint saves the device's RNG state
        (and fork_rng forks it) only when this says so."""
        return _connected() is not None

    def is_initialized(self) -> bool:
        return _connected() is not None

    @staticmethod
    def init() -> None:
        """Nothing to start lazily: `%genie_init` (genie_core.init) connects."""

    _lazy_init = init

    @staticmethod
    def is_available() -> bool:
        return device_count() > 0

    @staticmethod
    def device_count() -> int:
        return device_count()

    @staticmethod
    def _is_in_bad_fork() -> bool:
        """A fork of a process that had a session, which cannot use it (connection.py)."""
        from . import forks

        return forks.from_a_session

    @staticmethod
    def current_device() -> int:
        return current_index()

    @staticmethod
    def get_amp_supported_dtype() -> list[Any]:
        """torch.autocast asks this first (see autocast.py)."""
        from .autocast import supported_dtypes

        return supported_dtypes()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Run everything recorded so far on the device and wait for it (one round trip)."""
        stream_for(_index(device) if device is not None else None).flush(sync=True)

    # -- random numbers: the server device's generator ------------------------------------------
    @staticmethod
    def manual_seed(seed: int) -> None:
        """Seed the current device's generator (recorded; applied before the next ops run)."""
        stream_for(None).record(("seed", int(seed)))

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """Seed every device's generator (torch.manual_seed calls this)."""
        for index in range(device_count()):
            stream_for(index).record(("seed", int(seed)))

    @staticmethod
    def get_rng_state(device: Any = DEVICE_TYPE) -> Any:
        """The server device's generator state, as a CPU uint8 tensor (one round trip)."""
        from .stream import new_id

        stream = stream_for(_index(device))
        rid = new_id()
        stream.record(("rng_get", rid))
        try:
            return stream.fetch(rid)
        finally:
            stream.free(rid)

    @staticmethod
    def set_rng_state(new_state: Any, device: Any = DEVICE_TYPE) -> None:
        """Restore a state from get_rng_state (recorded; applied before the next ops run)."""
        from ..protocol.tensor_ops import HostTensor

        stream_for(_index(device)).record(("rng_set", HostTensor(new_state)))

    @staticmethod
    def get_rng_state_all() -> list[Any]:
        return [_DeviceModule.get_rng_state(i) for i in range(device_count())]

    @staticmethod
    def set_rng_state_all(new_states: Any) -> None:
        for i, state in enumerate(new_states):
            _DeviceModule.set_rng_state(state, i)

    @staticmethod
    def seed() -> None:
        import torch

        _DeviceModule.manual_seed(torch.seed())

    @staticmethod
    def seed_all() -> None:
        import torch

        _DeviceModule.manual_seed_all(torch.seed())

    @staticmethod
    def initial_seed() -> int:
        import torch

        return torch.initial_seed()

    # -- what the device is and holds: the server answers ---------------------------------------
    @staticmethod
    def get_device_properties(device: Any = None) -> Properties:
        index = _index(device) if device is not None else current_index()
        return DeviceProperties(**_ask(index, "properties"))

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return _DeviceModule.get_device_properties(device).name

    @staticmethod
    def get_device_capability(device: Any = None) -> tuple[int, int]:
        """(major, minor) of the server's GPU; (0, 0) for a server's CPU."""
        p = _DeviceModule.get_device_properties(device)
        return p.major, p.minor

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return _DeviceModule.get_device_properties().bf16_supported

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        """The server's allocator counters for this session's device, under torch.cuda's names."""
        index = _index(device) if device is not None else current_index()
        return dict(_ask(index, "memory"))

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        """Bytes held by this session's tensors on the device."""
        return _DeviceModule.memory_stats(device)["allocated_bytes.all.current"]

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        """The most bytes held at once since the start or reset_peak_memory_stats (a GPU server's
        allocator keeps this; a CPU server keeps no peak and refuses)."""
        stats = _DeviceModule.memory_stats(device)
        if "allocated_bytes.all.peak" not in stats:
            raise NotImplementedError(
                "max_memory_allocated: a server without a GPU keeps no peak (memory_allocated() is exact)"
            )
        return stats["allocated_bytes.all.peak"]

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return _DeviceModule.memory_stats(device)["reserved_bytes.all.current"]

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        stats = _DeviceModule.memory_stats(device)
        if "reserved_bytes.all.peak" not in stats:
            raise NotImplementedError("max_memory_reserved: a server without a GPU keeps no peak")
        return stats["reserved_bytes.all.peak"]

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of the server's device."""
        stats = _DeviceModule.memory_stats(device)
        return stats["free_bytes"], stats["total_bytes"]

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        _ask(_index(device) if device is not None else current_index(), "reset_peak")

    @staticmethod
    def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
        """The server allocator's report, as torch.cuda.memory_summary prints it (a CPU server, with
        no caching allocator, says what the session holds)."""
        return str(_ask(_index(device) if device is not None else current_index(), "memory_summary", abbreviated))

    @staticmethod
    def reset_accumulated_memory_stats(device: Any = None) -> None:
        """Reset the server allocator's counts of allocations, frees and retries (its `.allocated`,
        `.freed` and `num_*` stats)."""
        _ask(_index(device) if device is not None else current_index(), "reset_accumulated")

    @staticmethod
    def empty_cache() -> None:
        """Return the server allocator's cached, unused memory to the device (current device)."""
        _ask(current_index(), "empty_cache")

    @staticmethod
    def stats() -> dict[str, dict[str, float]]:
        """Per device index: round trips (batches waited for), messages (all batches sent), ops sent,
        and the worker's time running them (for benchmarks and curiosity)."""
        from .connection import live_streams

        return {
            f"{s.index}": {
                "round_trips": s.round_trips,
                "messages": s.messages,
                "ops_sent": s.ops_sent,
                "pending": s.pending(),
                "server_tensors": s.server_tensors,
                "server_seconds": round(s.server_seconds, 6),
                "wait_seconds": round(s.wait_seconds, 6),
            }
            for s in live_streams()
        }
