"""The server's own functions a client records as one "call" record: attention forward and
backward (genie_core/remote_tensor/attention.py), an aten op run whole with its backward
(genie_core/remote_tensor/whole_ops.py)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_unflatten, treespec_loads

from . import kept_graphs


def run_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], store: Any) -> list[Any]:
    """The server's own functions a client records as one call: the attention forward (keeping its
    graph under `graph`) or backward (see genie_core/remote_tensor/attention.py)."""
    if name == "sdpa":
        graph, needs = kwargs.pop("graph"), kwargs.pop("needs")
        query, key, value, mask = args
        if graph is None:
            with torch.no_grad():
                return [torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, **kwargs)]
        inputs = [
            t.detach().requires_grad_(n) if isinstance(t, torch.Tensor) else t for t, n in zip(args, needs, strict=True)
        ]
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                inputs[0], inputs[1], inputs[2], attn_mask=inputs[3], **kwargs
            )
        store[graph] = (out, inputs, needs)
        return [out.detach()]
    if name == "sdpa_backward":
        graph, grad_out = args
        found = store.get(graph)
        if not isinstance(found, tuple):
            raise RuntimeError(
                "the attention graph for this backward is gone (backward through it twice without retain_graph?)"
            )
        out, inputs, needs = found
        grads = iter(
            torch.autograd.grad(out, [t for t, n in zip(inputs, needs, strict=True) if n], grad_out, retain_graph=True)
        )
        return [next(grads) if n else None for n in needs]
    if name == "aten":
        return _run_whole(args, kwargs, store)
    if name == "aten_backward":
        graph, grads = args
        return kept_graphs.backward(store, graph, grads, kwargs.get("retain", True))
    raise ValueError(f"unknown server call {name!r}")


_spec = functools.cache(treespec_loads)  # the arguments' structure, by its text (one per op signature)


def _run_whole(args: tuple[Any, ...], kwargs: dict[str, Any], store: Any) -> list[Any]:
    """An aten op run whole with this device's kernels (genie_core/remote_tensor/whole_ops.py),
    keeping its graph under `graph` for the backward when a gradient is wanted."""
    graph, needs = kwargs["graph"], kwargs["needs"]
    packet, overload = kwargs["op"].removeprefix("aten.").split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)
    leaves, spec = list(args), _spec(kwargs["spec"])
    if graph is None:
        with torch.no_grad():
            op_args, op_kwargs = tree_unflatten(leaves, spec)
            out = op(*op_args, **op_kwargs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def run(leaves: list[Any]) -> Any:
        call_args, call_kwargs = tree_unflatten(leaves, spec)
        return op(*call_args, **call_kwargs)

    return kept_graphs.run_keeping_graph(run, leaves, needs, graph, store)
