"""Captured graphs on `remote_accelerator`, as `torch.cuda` has them: `CUDAGraph`, the `graph` context
manager and `make_graphed_callables`, for code written against CUDA graphs.

Ops recorded inside a capture are not sent: they become the graph, which goes to the server as one
record at the end of the capture; as on CUDA, the capture computes nothing (on a GPU server its ops are
recorded under `torch.cuda.graph`: a real CUDA graph). `replay()` is one record, however many ops
the graph holds. As on CUDA,
the tensors made in the capture are static: each replay writes its results into them, so the
inputs to change are changed in place (`static_input.copy_(new)`) and the outputs read after a
replay. What needs a value from the server (`.item()`, `.cpu()`, an op whose output shape depends
on the data) is refused inside a capture, as CUDA refuses synchronizing during one.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from .connection import DEVICE_TYPE, stream_for


class CUDAGraph:
    """A captured graph of device work (torch.cuda.CUDAGraph's methods)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._stream: Any = None
        self._id: int | None = None
        self._finalizer: Any = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.reset()
        self._stream = stream_for(None)
        self._stream.begin_capture()

    def capture_end(self) -> None:
        from .stream import new_id

        if self._stream is None or not self._stream.capturing:
            raise RuntimeError("capture_end: this graph is not being captured")
        records = self._stream.end_capture()
        self._id = new_id()
        self._stream.record(("capture", self._id, records))
        self._finalizer = weakref.finalize(self, self._stream.free, self._id)

    def _abandon(self) -> None:
        """A capture that failed: its ops are dropped; what the stream counts on having been sent
        (frees, compiled graphs' definitions, custom ops' imports and definitions) goes on as recorded."""
        if self._stream is not None and self._stream.capturing:
            for record in self._stream.end_capture():
                if record[0] in ("free", "graph", "import", "define"):
                    self._stream.record(record)

    def replay(self) -> None:
        """Run the graph again on the server: one record, no wait."""
        if self._id is None:
            raise RuntimeError("replay: this graph has not been captured (capture_begin/capture_end, or graph())")
        self._stream.record(("replay", self._id))

    def reset(self) -> None:
        """Free the captured graph on the server (a later capture makes a new one)."""
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer, self._id = None, None

    def pool(self) -> tuple[int, int]:
        """An opaque handle, as torch.cuda's: the server gives each graph its own memory."""
        return (0, self._id or 0)

    def enable_debug_mode(self) -> None:
        """Nothing to turn on: the graph's records are what it runs."""

    def debug_dump(self, debug_path: str) -> None:
        raise NotImplementedError(
            f"debug_dump: a {DEVICE_TYPE} graph is a list of ops on the server, not a CUDA graph here"
        )


class graph:
    """`with torch.remote_accelerator.graph(g): ...` captures the block's device work into `g`."""

    default_capture_stream: Any = None

    def __init__(
        self, cuda_graph: CUDAGraph, pool: Any = None, stream: Any = None, capture_error_mode: str = "global"
    ) -> None:
        self.cuda_graph = cuda_graph
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        gc.collect()  # frees due now are recorded before the capture, as torch.cuda.graph collects first
        self.cuda_graph.capture_begin(capture_error_mode=self.capture_error_mode)

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is not None:
            self.cuda_graph._abandon()
            return
        self.cuda_graph.capture_end()


def is_current_stream_capturing() -> bool:
    return stream_for(None).capturing


def graph_pool_handle() -> tuple[int, int]:
    """An opaque handle (pools are the server's to share)."""
    return (0, 0)


def make_graphed_callables(
    callables: Any, sample_args: Any, num_warmup_iters: int = 3, allow_unused_input: bool = False, pool: Any = None
) -> Any:
    """Graphed versions of functions or modules (torch.cuda.make_graphed_callables): forward and
    backward each captured once, after a few warm-up runs, and replayed at each call, with new
    inputs copied into the sample arguments (the static inputs) and gradients returned from the
    backward graph's static outputs."""
    import torch

    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    graphed = []
    for fn, args in zip(callables, sample_args, strict=True):
        if isinstance(fn, torch.nn.Module) and (fn._backward_hooks or fn._forward_hooks or fn._forward_pre_hooks):
            raise RuntimeError("make_graphed_callables: modules must have no hooks registered (as on CUDA)")
        params = tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else ()
        graphed.append(_graph_one(fn, tuple(args), params, num_warmup_iters, allow_unused_input))
    return graphed[0] if single else tuple(graphed)


def _graph_one(fn: Any, static_inputs: tuple, params: tuple, warmups: int, allow_unused: bool) -> Any:
    import torch

    surface = static_inputs + params
    wants = [t for t in surface if isinstance(t, torch.Tensor) and t.requires_grad]
    outs: Any = None
    needing: Any = None
    for _ in range(warmups):  # fills the meta-shape caches (and the server's): nothing may need it in the capture
        outs = _as_tuple(fn(*static_inputs))
        needing = [o for o in outs if o.requires_grad]
        if needing and wants:
            torch.autograd.grad(needing, wants, [torch.empty_like(o) for o in needing], allow_unused=allow_unused)
    del outs, needing
    forward_graph, backward_graph = CUDAGraph(), CUDAGraph()
    with graph(forward_graph):
        static_outputs = _as_tuple(fn(*static_inputs))
    differentiable = [o.requires_grad for o in static_outputs]
    static_grad_outputs = tuple(
        torch.empty_like(o) if d else None for o, d in zip(static_outputs, differentiable, strict=True)
    )
    needing = [o for o, d in zip(static_outputs, differentiable, strict=True) if d]
    with graph(backward_graph):
        grads = (
            torch.autograd.grad(
                needing, wants, [g for g in static_grad_outputs if g is not None], allow_unused=allow_unused
            )
            if needing and wants
            else ()
        )
    found = iter(grads)
    static_grad_inputs = tuple(
        next(found) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in surface
    )

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: Any) -> Any:
            for static, new in zip(surface, inputs, strict=True):
                if isinstance(static, torch.Tensor) and new is not static:
                    static.copy_(new)
            forward_graph.replay()
            outs = tuple(o.detach() for o in static_outputs)
            ctx.mark_non_differentiable(*[o for o, d in zip(outs, differentiable, strict=True) if not d])
            return outs

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            for static, grad in zip(static_grad_outputs, grads, strict=True):
                if static is not None and grad is not None:
                    static.copy_(grad)
            backward_graph.replay()
            return tuple(g.detach() if g is not None else None for g in static_grad_inputs)

    def run(*args: Any) -> Any:
        outs = Graphed.apply(*args, *params)
        return outs[0] if len(outs) == 1 else outs

    if isinstance(fn, torch.nn.Module):
        original, training = fn.forward, fn.training

        def forward(*args: Any) -> Any:
            return run(*args) if fn.training == training else original(*args)

        fn.forward = forward
        return fn
    return run


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)
