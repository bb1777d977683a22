"""Autograd graphs the server keeps for a client's backward: an op run whole (whole_ops.py) or a
compiled graph runs here under autograd, with the inputs that need a gradient as its leaves, and
its graph is kept under an id; the client's backward is then one `aten_backward` call that runs
`torch.autograd.grad` on it (attention keeps its own, older form)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def run_keeping_graph(
    run: Callable[[list[Any]], Any], args: list[Any], needs: list[bool], graph: int, store: Any
) -> list[Any]:
    """`run(args)` under autograd, its tensor outputs and the inputs needing a gradient kept in
    `store[graph]`; the outputs, detached. An input that needs none goes in as it is (a static
    input of a CUDA graph must stay the tensor that was marked)."""
    args = list(args)
    inputs: list[Any] = []
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for i, need in zip(tensors, needs, strict=True):
        if need:
            args[i] = args[i].detach().requires_grad_(True)
        inputs.append(args[i] if need else None)
    with torch.enable_grad():
        out = run(args)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
    store[graph] = (outs, inputs)
    return [o.detach() for o in outs]


def backward(store: Any, graph: int, grads: list[Any], retain: bool) -> list[Any]:
    """The gradients of a kept graph's inputs (None where none was wanted). `retain`: keep the graph
    for another backward, as the client's own backward does or not (Inductor's compiled backward,
    whose buffers are donated, refuses to)."""
    found = store.get(graph)
    if not isinstance(found, tuple):
        raise RuntimeError("the graph for this backward is gone (backward through it twice without retain_graph?)")
    outs, inputs = found
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None]
    wanted = [t for t in inputs if t is not None]
    got = iter(
        torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], retain_graph=retain, materialize_grads=True
        )
    )
    return [next(got) if t is not None else None for t in inputs]
