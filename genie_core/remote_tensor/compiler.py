"""`torch.compile` on `remote_accelerator`: Dynamo traces here, the server compiles and runs.

Dynamo sees a remote tensor as a fake tensor of the device (`RemoteTensor.__tensor_unflatten__`),
so guards, recompiles, graph breaks and dynamic shapes are Dynamo's own, as on CUDA. The graph it
captures goes to the server once per session (content-hashed) and is compiled there with the
server device's compiler (Inductor, with its CUDA graphs for `mode="reduce-overhead"`); each call
is then one recorded op carrying its inputs' ids, whose outputs' shapes come from the fake
tensors of the trace (symbolic sizes evaluated against the call's). A gradient through a compiled
graph is one more recorded call that runs the server's backward of it.

`torch.compile(model)` with the default backend routes graphs that hold remote tensors here (the
rest go to Inductor as before); `torch.compile(model, backend="remote_accelerator",
options={"compiler": "eager"})` asks for a backend explicitly ("eager" runs the captured graph as
it is, "inductor" compiles it, with Inductor's own options beside).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import torch_compat
from ..protocol import fx_graph
from ..protocol.tensor_ops import HostTensor
from . import custom_ops
from .after_import import after_import
from .attention import _Graph
from .attention import _meta as meta_like
from .connection import DEVICE_TYPE, stream_for
from .tensor import RemoteTensor, _encode_other, record_call

COMPILERS = ("inductor", "eager")
stats = {"graphs": 0}  # graphs compiled here (Dynamo's recompiles included), for benchmarks and tests


class _Output:
    """One output of a graph: a tensor (its metadata, symbolic where the trace was), a number, or a constant."""

    __slots__ = ("constant", "device", "differentiable", "dtype", "exprs", "is_tensor", "meta", "rank")

    def __init__(self, value: Any) -> None:
        self.is_tensor = isinstance(value, torch.Tensor)
        self.constant, self.meta, self.exprs = None, None, None
        self.dtype = self.device = None
        self.differentiable = False
        self.rank = 0
        if self.is_tensor:
            self.dtype, self.device = value.dtype, value.device
            self.differentiable = bool(value.requires_grad)
            self.rank = value.dim()
            parts = [*value.shape, *value.stride(), value.storage_offset()]
            if all(isinstance(p, int) for p in parts):
                self.meta = _meta(value.shape, value.stride(), value.storage_offset(), value.dtype)
            else:
                self.exprs = [_expr(p) for p in parts]
        elif isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            self.exprs = [_expr(value)]
        else:
            self.constant = value


def _meta(shape: Any, stride: Any, offset: int, dtype: Any) -> Any:
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta").as_strided(shape, stride, offset)


def _expr(value: Any) -> Any:
    return value.node.expr if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool) else value


class _Shapes:
    """Binds the trace's size symbols to a call's inputs and evaluates the outputs' sizes: Python
    code generated once from the symbolic expressions."""

    def __init__(self, inputs: list[Any], outputs: list[_Output]) -> None:
        import sympy  # type: ignore[import-untyped]
        from torch.utils._sympy.printers import PythonPrinter

        self.binders: list[tuple[int, str, int, str]] = []  # (input, "size"|"stride"|"offset"|"value", dim, symbol)
        bound: set[str] = set()
        for i, value in enumerate(inputs):
            if isinstance(value, torch.Tensor):
                parts: list[tuple[str, int, Any]] = [("size", d, s) for d, s in enumerate(value.shape)]
                parts += [("stride", d, s) for d, s in enumerate(value.stride())]
                parts.append(("offset", 0, value.storage_offset()))
            else:
                parts = [("value", 0, value)]
            for where, dim, part in parts:
                expr = _expr(part)
                if isinstance(expr, sympy.Symbol) and expr.name not in bound:
                    bound.add(expr.name)
                    self.binders.append((i, where, dim, expr.name))
        exprs = [e for o in outputs if o.exprs is not None for e in o.exprs]
        free = {s.name for e in exprs if isinstance(e, sympy.Basic) for s in e.free_symbols}
        self.unbound = sorted(free - bound)
        printer = PythonPrinter()
        body = ", ".join(printer.doprint(e) if isinstance(e, sympy.Basic) else repr(e) for e in exprs)
        names = [b[3] for b in self.binders]
        self.evaluate = eval(f"lambda {', '.join(names) or '*_'}: ({body},)", {"math": math})  # (our printer's code)

    def values(self, args: tuple) -> list[Any]:
        found = []
        for i, where, dim, _ in self.binders:
            a = args[i]
            if where == "size":
                found.append(a.shape[dim])
            elif where == "stride":
                found.append(a.stride(dim))
            elif where == "offset":
                found.append(a.storage_offset())
            else:
                found.append(a)
        return list(self.evaluate(*found))


class CompiledGraph:
    """What the backend returns to Dynamo: called with the real inputs each time the guards pass."""

    def __init__(self, gm: Any, compiler: str, options: dict[str, Any], dynamic: bool | None) -> None:
        self._constants: list[Any] = []  # remote tensors the graph holds as constants: kept alive with it
        self.nodes = fx_graph.encode(gm, self._constant)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        examples = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
        self.static = [
            i for i, n in enumerate(placeholders) if n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
        ]
        output = next(n for n in gm.graph.nodes if n.op == "output")
        values = output.args[0]
        self.tuple_out = isinstance(values, (tuple, list))
        values = list(values) if self.tuple_out else [values]
        self.outputs = [
            _Output(v.meta.get("example_value", v.meta.get("val")) if isinstance(v, torch.fx.Node) else v)
            for v in values
        ]
        symbolic = any(o.exprs is not None for o in self.outputs)
        self.shapes = _Shapes(examples, self.outputs) if symbolic else None
        if dynamic is None and any(
            isinstance(e, torch.Tensor) and not all(isinstance(s, int) for s in e.shape) for e in examples
        ):
            dynamic = True
        self.how = {"compiler": compiler, "options": options, "dynamic": dynamic, "static": self.static}
        self.key = fx_graph.digest(self.nodes, self.how)
        self.differentiable = any(o.differentiable for o in self.outputs)
        self.custom_ops = {  # ops of torch.library: their modules are imported on the server first
            n.target
            for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket)
            and str(n.target).split(".")[0] not in ("aten", "prims")
        }
        self.index = _device_index(examples)
        stats["graphs"] += 1

    def _constant(self, value: Any) -> Any:
        if type(value) is RemoteTensor:
            self._constants.append(value)
            return value._ref
        if isinstance(value, torch.Tensor):
            return HostTensor(value)
        raise NotImplementedError(
            f"torch.compile on {DEVICE_TYPE}: the graph holds a {type(value).__name__}, which cannot go to the server"
        )

    def __call__(self, *args: Any) -> Any:
        stream = None
        for a in args:
            if type(a) is RemoteTensor:
                stream = a._stream
                break
        if stream is None:
            stream = stream_for(self.index)
        if self.key not in stream.graphs:
            for op in self.custom_ops:
                custom_ops.make_known(op, stream)
            stream.record(("graph", self.key, self.nodes, self.how))
            stream.graphs.add(self.key)
        expected, numbers = self._expected(args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self.differentiable and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            made = _GraphCall.apply(self, stream, args, expected, *tensors)
            made = list(made) if isinstance(made, tuple) else [made]
        else:
            made = _record(self, stream, args, expected, None, None)
        results, tensor_outs, values = [], iter(made), iter(numbers)
        for out in self.outputs:
            if out.is_tensor:
                t = next(tensor_outs)
                results.append(t if out.device is None or out.device.type == DEVICE_TYPE else t.to(out.device))
            elif out.exprs is not None:
                results.append(next(values))
            else:
                results.append(out.constant)
        return tuple(results) if self.tuple_out else results[0]

    def _expected(self, args: tuple) -> tuple[list[Any], list[Any]]:
        """The tensor outputs' metadata (meta tensors) and the numbers output, for these inputs."""
        if self.shapes is None:
            return [o.meta for o in self.outputs if o.is_tensor], []
        if self.shapes.unbound:
            raise NotImplementedError(
                f"torch.compile on {DEVICE_TYPE}: an output's size depends on the data "
                f"({', '.join(self.shapes.unbound)}); Dynamo graph-breaks there by default "
                "(capture_dynamic_output_shape_ops/capture_scalar_outputs are not supported)"
            )
        values = iter(self.shapes.values(args))
        expected, numbers = [], []
        for out in self.outputs:
            if out.is_tensor and out.meta is not None:
                expected.append(out.meta)
            elif out.is_tensor:
                parts = [int(next(values)) for _ in range(2 * out.rank + 1)]
                expected.append(_meta(parts[: out.rank], parts[out.rank : -1], parts[-1], out.dtype))
            elif out.exprs is not None:
                numbers.append(next(values))
        return expected, numbers


def _device_index(examples: list[Any]) -> int | None:
    for e in examples:
        if isinstance(e, torch.Tensor) and e.device.type == DEVICE_TYPE:
            return e.device.index
    return None


def _encode_input(a: Any) -> Any:
    """A graph input: a remote tensor by id, a CPU tensor by value (it stays on the server's CPU, as
    the graph expects), a number as it is."""
    if type(a) is RemoteTensor:
        return a._ref
    if isinstance(a, torch.Tensor):
        return HostTensor(a) if a.device.type == "cpu" else _refuse(a)
    return _encode_other(a)


def _refuse(a: Any) -> Any:
    raise RuntimeError(f"torch.compile on {DEVICE_TYPE}: an input on {a.device} cannot go to the server")


def _record(graph: CompiledGraph, stream: Any, args: tuple, expected: list[Any], gid: Any, needs: Any) -> list[Any]:
    enc = tuple(_encode_input(a) for a in args)
    made, _ = record_call(
        "graph", enc, {"key": graph.key, "graph": gid, "needs": needs}, expected, stream=stream, encoded=True
    )
    return made


class _GraphCall(torch.autograd.Function):
    """A compiled graph's call where a gradient is wanted: the server keeps its autograd graph, and
    the backward is one call that runs it (`aten_backward` in worker/tensors.py)."""

    @staticmethod
    def forward(ctx: Any, graph: CompiledGraph, stream: Any, args: tuple, expected: list[Any], *tensors: Any) -> Any:
        from .stream import new_id

        needs = [bool(n) for n in ctx.needs_input_grad[4:]]
        gid = new_id()
        made = _record(graph, stream, args, expected, gid, needs)
        ctx.graph = _Graph(stream, gid)
        # each gradient like its input, fresh (offset 0); a CPU input's comes back to the CPU
        ctx.inputs = [meta_like(t) if n else None for t, n in zip(tensors, needs, strict=True)]
        ctx.devices = [t.device for t in tensors]
        ctx.differentiable = [o.differentiable for o in graph.outputs if o.is_tensor]
        ctx.mark_non_differentiable(*[t for t, d in zip(made, ctx.differentiable, strict=True) if not d])
        return tuple(made) if len(made) != 1 else made[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():  # backward(create_graph=True): these gradients have no graph here
            ctx.graph.stream.defer(
                "torch.compile's backward",
                RuntimeError(
                    f"double backward (create_graph=True) through a graph compiled on {DEVICE_TYPE} is not "
                    "supported, as torch.compile's aot_autograd refuses it: its second-order terms would be missing"
                ),
            )
        sent = [g if d else None for g, d in zip(grads, ctx.differentiable, strict=True)]
        retain = torch._C._autograd._get_current_graph_task_keep_graph()  # backward(retain_graph=...)
        found, _ = record_call("aten_backward", (ctx.graph.id, sent), {"retain": retain}, ctx.inputs)
        found = [g if g is None or d.type == DEVICE_TYPE else g.to(d) for g, d in zip(found, ctx.devices, strict=True)]
        return (None, None, None, None, *found)


def backend(gm: Any, example_inputs: list[Any], mode: str | None = None, options: dict[str, Any] | None = None) -> Any:
    """The `remote_accelerator` backend of torch.compile: `options={"compiler": "eager"}` runs the
    captured graph as it is on the server; otherwise Inductor compiles it there, with `mode` and
    the rest of `options` as Inductor takes them."""
    options = dict(options or {})
    compiler = options.pop("compiler", "inductor")
    if compiler not in COMPILERS:
        raise ValueError(f"options['compiler'] is {compiler!r}; the server compiles with one of {', '.join(COMPILERS)}")
    if mode and mode != "default":
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode), **options}
    return CompiledGraph(gm, compiler, options, None)


def _holds_remote(gm: Any, inputs: list[Any]) -> bool:
    """Whether a graph works on the device: an input on it, or a tensor made on it."""
    if any(type(x) is RemoteTensor for x in inputs):
        return True
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and value.device.type == DEVICE_TYPE:
            return True
    return False


_registered = False


def register() -> None:
    """Send the default backend's graphs that hold remote tensors here (the rest go to Inductor as
    before). The named backend is found through the `torch_dynamo_backends` entry point, so that
    registering the device does not import Dynamo."""
    global _registered
    if _registered:
        return
    wrapper = torch._TorchCompileInductorWrapper
    inductor_call = wrapper.__call__

    def call(self: Any, model_: Any, inputs_: Any, *, config_patches: Any = None) -> Any:
        if _holds_remote(model_, inputs_):
            return CompiledGraph(model_, "inductor", {**self.config, **(config_patches or {})}, self.dynamic)
        return inductor_call(self, model_, inputs_, config_patches=config_patches)

    wrapper.__call__ = call  # type: ignore[method-assign]
    after_import("torch._dynamo", _leave_alone)
    after_import("torch._subclasses.fake_tensor", torch_compat.fake_tensors_take_plain_wrappers)
    _registered = True


def _leave_alone() -> None:
    """Dynamo compiles every Python frame that runs while a compiled function's eager parts do (after a
    graph break), and this package's frames run there: inside PyTorch's dispatch of remote tensors.
    Listed as skipped, they run as plain Python, as PyTorch's own do."""
    import torch._dynamo

    torch._dynamo.trace_rules.add("genie_core")
