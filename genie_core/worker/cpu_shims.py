"""Ops a CUDA device runs that a CPU server's kernels refuse, done there the way CUDA would: model
code written for "not the CPU" relies on them, and a CPU server stands in for a GPU in tests."""

from __future__ import annotations

from typing import Any

import torch


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Any:
    """CUDA counts integer tensors, the CPU kernel refuses them: counted in float64, exact below
    2**53, returned in the input's dtype."""
    if x.is_floating_point():
        return torch.ops.aten.histc.default(x, bins, min, max)
    return torch.ops.aten.histc.default(x.double(), bins, min, max).to(x.dtype)


CPU_SHIMS = {"aten.histc.default": histc}  # recorded ops, by name


def shim_graph(gm: Any) -> None:
    """The same shims in a compiled graph's calls (`torch.histc`, `x.histc()`, the aten op)."""
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target in (torch.histc, torch.ops.aten.histc.default)) or (
            node.op == "call_method" and node.target == "histc"
        ):
            node.op, node.target = "call_function", histc
    gm.recompile()
