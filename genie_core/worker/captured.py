"""The worker side of `torch.remote_accelerator.graph`: ops a client captured, replayed on one
message (genie_core/remote_tensor/captured.py is the client side).

On a GPU the records run once under `torch.cuda.graph`, so the replay is a real CUDA graph: its
outputs live in the graph's memory and each replay writes them in place. On a CPU the records run
again at each replay and their results are copied into the tensors the capture made, so that what
the client holds (a static output, a view of it taken later) sees the new values, as on CUDA.

Either way the tensors a capture made are the graph's memory: they stay as long as the graph does,
even after the client lets them go, because another graph may read them (make_graphed_callables'
backward graph reads what its forward graph saved)."""

from __future__ import annotations

from typing import Any

import torch


class CapturedGraph:
    """One capture: its records, run now (the capture), and again or as a CUDA graph at each replay."""

    def __init__(self, executor: Any, records: list[tuple[Any, ...]]) -> None:
        self.executor = executor
        self.records = records
        made = [rid for r in records if r[0] in ("op", "call") for rid in r[4] if rid is not None]
        self.cuda_graph: Any = None
        if executor.device.type == "cuda":
            self.cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.cuda_graph):
                self._run()
        else:
            self._run()
        store = executor.store
        self.memory = {rid: store[rid] for rid in made if isinstance(store.get(rid), torch.Tensor)}
        executor.graph_memory.update(self.memory)

    def _run(self) -> None:
        for index, record in enumerate(self.records):
            try:
                self.executor.step(record)
            except Exception as exc:
                name = record[1] if record[0] in ("op", "call") else record[0]
                raise RuntimeError(
                    f"{name} (op {index + 1} of {len(self.records)} in the graph) failed: {type(exc).__name__}: {exc}"
                ) from exc

    def replay(self) -> None:
        if self.cuda_graph is not None:
            self.cuda_graph.replay()
            return
        self._run()
        store = self.executor.store
        for rid, old in self.memory.items():
            new = store.get(rid)
            if isinstance(new, torch.Tensor) and new is not old:
                if new.data_ptr() != old.data_ptr() or new.stride() != old.stride():
                    old.copy_(new)
                store[rid] = old

    def release(self) -> None:
        """The client let the graph go: its memory goes with it."""
        for rid in self.memory:
            self.executor.graph_memory.pop(rid, None)
        self.memory = {}
