"""The worker side of `torch.compile` on remote tensors: the graphs a client traced, compiled with
this device's compiler (genie_core/remote_tensor/compiler.py is the client side).

A graph arrives once per session, by content hash, and is compiled at its first call, as
torch.compile would compile it on this device: Inductor (on a GPU with its CUDA graphs for
`mode="reduce-overhead"`, the inputs that were parameters or buffers marked static), or the graph
as it is ("eager"). Dynamo runs here too, over the graph, so a call with other input shapes or
requires-grad flags recompiles here as it would locally."""

from __future__ import annotations

from typing import Any

import torch

from ..protocol import fx_graph
from ..protocol.tensor_ops import HostTensor, TensorRef, ref_id
from .cpu_shims import shim_graph
from .kept_graphs import run_keeping_graph


class _Graph:
    __slots__ = ("compiled", "how", "module")

    def __init__(self, module: Any, how: dict[str, Any]) -> None:
        self.module, self.how = module, how
        self.compiled: Any = None

    def function(self) -> Any:
        if self.compiled is None:
            if self.how["compiler"] == "eager":
                self.compiled = self.module
            else:
                options = dict(self.how["options"] or {})
                if options.get("triton.cudagraphs"):
                    # Inductor's CUDA graph trees segfaulted here (torch 2.11, an H100: the static
                    # launcher's first kernel launch in the trees' warm-up of GPT-2's static-cache
                    # decode), where its plain CUDA graphs run the same graphs, replayed as captured.
                    # Trees asked for by name are still used.
                    options.setdefault("triton.cudagraph_trees", False)
                self.compiled = torch.compile(
                    self.module, backend="inductor", options=options or None, dynamic=self.how["dynamic"]
                )
        return self.compiled


class CompiledGraphs:
    """The session's compiled graphs, by the content hash the client named them with."""

    def __init__(self, device: torch.device, store: Any) -> None:
        self.device = device
        self.store = store
        self._graphs: dict[str, _Graph] = {}

    def define(self, key: str, nodes: list[fx_graph.Node], how: dict[str, Any]) -> None:
        if key not in self._graphs:
            module = fx_graph.decode(nodes, self.device, self._constant)
            if self.device.type == "cpu":
                shim_graph(module)
            self._graphs[key] = _Graph(module, how)

    def _constant(self, value: Any) -> Any:
        if type(value) is TensorRef:
            return self.store[ref_id(value)]
        if type(value) is HostTensor:
            return value.tensor
        return value

    def run(self, key: str, args: list[Any], graph: int | None, needs: list[bool] | None) -> list[Any]:
        """The graph's tensor outputs for these inputs; with `graph`, its autograd graph is kept
        under that id for the backward (kept_graphs.py)."""
        entry = self._graphs.get(key)
        if entry is None:
            raise RuntimeError(f"compiled graph {key} is not on the server (sent to another session?)")
        for i in entry.how["static"] if entry.how["compiler"] != "eager" else ():
            if isinstance(args[i], torch.Tensor) and not hasattr(args[i], "_dynamo_static_input_type"):
                torch._dynamo.mark_static_address(args[i], guard=False)
        function = entry.function()
        if graph is None:
            with torch.no_grad():
                out = function(*args)
            return [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        return run_keeping_graph(lambda leaves: function(*leaves), args, needs or [], graph, self.store)
