"""The worker side of `torch.remote_accelerator.graph`: ops a client captured, replayed on one
message (genie_core/remote_tensor/captured.py is the client side).

As on CUDA, a capture computes nothing but makes the tensors the graph writes: on a GPU the ops
run under `torch.cuda.graph`, which records them, and each replay is the CUDA graph's, writing its
outputs in place; on a CPU the capture makes each output empty, laid out as the client expects it,
and the ops run at each replay, their results copied into those tensors, so that what the client
holds (a static output, a view of it taken later) sees the new values. What a captured list
does once (upload a CPU tensor, seed, import a module, free a tensor made before the capture) is
done at the capture, not at each replay.

The tensors a graph made, and the ones it uploaded, are its memory: they stay as long as the graph
does, even once the client lets them go, because another graph may read them (make_graphed_callables'
backward graph reads what its forward graph saved)."""

from __future__ import annotations

from typing import Any

import torch

from ..protocol.op_records import Expect, Record, name_of

_ONCE = frozenset({"put", "seed", "rng_set", "import", "define", "graph", "fail", "clock"})


class CapturedGraph:
    """One capture: what it does once, done now; its ops, recorded (GPU) or kept to run (CPU)."""

    def __init__(self, executor: Any, records: list[Record]) -> None:
        self.executor = executor
        self.made = {rid for r in records if r[0] == "op" or r[0] == "call" for rid in r[4] if rid is not None}
        uploaded = {r[1] for r in records if r[0] == "put"}
        self.ops = [r for r in records if r[0] not in _ONCE and (r[0] != "free" or r[1] in self.made)]
        before_free = [r for r in records if r[0] == "free" and r[1] not in self.made and r[1] not in uploaded]
        for record in records:
            if record[0] in _ONCE:
                executor.step(record)
        store = executor.store
        # the uploads are the graph's (they live in its memory, not the store, and their frees are moot)
        self.memory: dict[int, torch.Tensor] = {rid: store.pop(rid) for rid in uploaded}
        executor.graph_memory.update(self.memory)  # (read from there by the capture below already)
        self.dropped: set[int] = set()  # made ids the client let go: out of the store after a replay
        self.cuda_graph: Any = None
        if executor.device.type == "cuda":
            self.cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.cuda_graph):
                self._run()
            self.memory.update({rid: store[rid] for rid in self.made if isinstance(store.get(rid), torch.Tensor)})
        else:  # what the graph makes and the client keeps, made now with nothing in it (as CUDA's capture does)
            transient = {r[1] for r in self.ops if r[0] == "free"}
            for r in self.ops:
                if r[0] == "op" or r[0] == "call":
                    for rid, want in zip(r[4], r[5] or (), strict=False):
                        if rid is not None and want is not None and rid not in transient:
                            store[rid] = self.memory[rid] = _empty(want, executor.device)
        for record in before_free:  # a tensor of before the capture, let go during it
            executor.step(record)
        executor.adopt(self)

    def _run(self) -> None:
        for index, record in enumerate(self.ops):
            try:
                self.executor.step(record)
            except Exception as exc:
                where = f"op {index + 1} of {len(self.ops)} in the graph"
                raise RuntimeError(f"{name_of(record)} ({where}) failed: {type(exc).__name__}: {exc}") from exc

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
            if rid in self.dropped:
                store.pop(rid, None)

    def release(self) -> None:
        """The client let the graph go: its memory goes with it."""
        for rid in self.made | set(self.memory):
            self.executor.graph_memory.pop(rid, None)
            self.executor.graph_of.pop(rid, None)
        self.memory = {}


def _empty(want: Expect, device: torch.device) -> torch.Tensor:
    """A tensor laid out as an op's output will be (shape, strides, offset, dtype), nothing in it."""
    shape, stride, offset, dtype = want
    size = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else offset
    base = torch.empty(size, dtype=dtype, device=device)
    return base.as_strided(shape, stride, offset)
