"""Ops the server runs whole, with its own device's kernels, instead of as PyTorch decomposes them
for an unknown device.

The recurrent layers (`lstm`, `gru`, `rnn_tanh`, `rnn_relu` and their cells) are composite ops
that pick their kernels by device type: for any device but the CPU they decompose into the fused
cell kernels (`_thnn_fused_lstm_cell`), which exist only for CUDA, and on a GPU server they would
miss cuDNN. So they are taken over at `AutogradPrivateUse1`: the forward is one call that the
server runs with the op itself (the CPU's kernels on a CPU server, cuDNN on a GPU), keeping its
autograd graph when a gradient is wanted, and the backward is one call that runs
`torch.autograd.grad` on that graph (the server's half is `run_call` in worker/server_calls.py).
The packed-sequence ops go the same way: arguments and outputs that PyTorch keeps on the CPU (a
packed sequence's lengths and batch sizes) stay there.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps

from ..protocol.tensor_ops import HostTensor
from .attention import _Graph

aten = torch.ops.aten

TAKEN_OVER = (
    aten.lstm.input,
    aten.lstm.data,
    aten.gru.input,
    aten.gru.data,
    aten.rnn_tanh.input,
    aten.rnn_tanh.data,
    aten.rnn_relu.input,
    aten.rnn_relu.data,
    aten.lstm_cell.default,
    aten.gru_cell.default,
    aten.rnn_tanh_cell.default,
    aten.rnn_relu_cell.default,
    aten._pack_padded_sequence.default,
    aten._pad_packed_sequence.default,
)

_outputs: dict[Any, list[Any]] = {}
_lib: Any = None


def _meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":  # CPU arguments stay CPU
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _sig(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return (t.shape, t.stride(), t.dtype, t.device.type, tuple(t.tolist()) if t.device.type == "cpu" else None)
    return t


def _expected(op: Any, leaves: list[Any], spec: Any) -> list[Any]:
    """The outputs' metadata (meta tensors), from PyTorch's own decomposition on meta tensors, cached
    by signature (CPU arguments, like batch sizes, by value). Argument errors are raised here."""
    key = (op, spec, tuple(_sig(x) for x in leaves))
    found = _outputs.get(key)
    if found is None:
        args, kwargs = tree_unflatten([_meta(x) for x in leaves], spec)
        out = op(*args, **kwargs)
        found = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(_outputs) > 10_000:
            _outputs.clear()
        _outputs[key] = found
    return found


_spec_text = functools.cache(treespec_dumps)  # the arguments' structure, as the server rebuilds it


class _ServerOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: Any, leaves: list[Any], spec: Any, where: list[int], *tensors: Any) -> Any:
        from .stream import new_id
        from .tensor import record_call

        leaves = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            leaves[i] = t
        expected = _expected(op, leaves, spec)
        needs = [bool(n) for n in ctx.needs_input_grad[4:]]
        gid = new_id() if any(needs) else None
        sent = tuple(HostTensor(x) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x for x in leaves)
        on_device = [m if m.device.type == "meta" else None for m in expected]
        made, stream = record_call(
            "aten", sent, {"op": str(op), "spec": _spec_text(spec), "graph": gid, "needs": needs}, on_device
        )
        # outputs PyTorch makes on the CPU (a packed sequence's batch sizes) come from the meta run
        outs = [m.clone() if r is None else r for r, m in zip(made, expected, strict=True)]
        ctx.differentiable = [r is not None and r.is_floating_point() for r in made]
        if gid is not None:
            ctx.graph = _Graph(stream, gid)
            ctx.inputs = [_meta(t) if n else None for t, n in zip(tensors, needs, strict=True)]
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, ctx.differentiable, strict=True) if not d])
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        from .tensor import record_call

        sent = tuple(g if d else None for g, d in zip(grads, ctx.differentiable, strict=True))
        found, _ = record_call("aten_backward", (ctx.graph.id, sent), {}, ctx.inputs)
        return (None, None, None, None, *found)


def _take_over(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        from .tensor import RemoteTensor

        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if not any(type(leaves[i]) is RemoteTensor for i in where):  # fake tensors: torch.compile traces
            return op.decompose(*args, **kwargs)
        return _ServerOp.apply(op, leaves, spec, where, *[leaves[i] for i in where])

    return kernel


def register() -> None:
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    for op in TAKEN_OVER:
        name = op._schema.name.split("::")[1]
        _lib.impl(
            name if op._overloadname == "default" else f"{name}.{op._overloadname}",
            _take_over(op),
            "AutogradPrivateUse1",
        )
