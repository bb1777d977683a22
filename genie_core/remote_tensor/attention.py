"""`scaled_dot_product_attention` as one op that the server runs with its own kernel choice.

PyTorch picks the attention kernel (flash, memory-efficient, math) by device type, and only for
devices it knows: on `remote_accelerator` it would always decompose into the math version,
slower on a GPU and not bit-equal to what the server's device computes natively. So the op is
taken over at `AutogradPrivateUse1`: the forward is recorded as one call that the server runs
with `torch.nn.functional.scaled_dot_product_attention` (keeping its autograd graph when a
gradient is wanted), and the backward as one call that runs `torch.autograd.grad` on that graph
(the server's half is `run_call` in genie_core/worker/server_calls.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_lib: Any = None


def _meta(t: Any) -> Any:
    if t is None or not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


_outputs: dict[Any, Any] = {}


def _output(
    query: Any, key: Any, value: Any, mask: Any, dropout_p: float, is_causal: bool, scale: Any, gqa: bool
) -> Any:
    """The output's metadata (a meta tensor), cached by signature: PyTorch's meta path decomposes
    the whole math attention, about 5 ms a call. Argument errors are raised here, as PyTorch would."""
    sig = tuple((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t for t in (query, key, value, mask))
    k = (sig, dropout_p, is_causal, scale, gqa, query._stream.device_kind)
    out = _outputs.get(k)
    if out is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            _meta(query),
            _meta(key),
            _meta(value),
            attn_mask=_meta(mask),
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=gqa,
        )
        if query._stream.device_kind == "cpu" and out.dim() == query.dim():
            # The CPU kernels lay the output out in the query's dimension order (a query that is a
            # transposed (batch, length, heads, dim) tensor gives an output laid out the same way).
            order = sorted(range(query.dim()), key=lambda d: (-query.stride(d), d))
            out = torch.empty_permuted(out.shape, order, dtype=out.dtype, device="meta")
        if len(_outputs) > 10_000:
            _outputs.clear()
        _outputs[k] = out
    return out


class _Graph:
    """The server-side autograd graph of one attention call; freed with the local graph node."""

    def __init__(self, stream: Any, gid: int) -> None:
        self.id, self.stream = gid, stream
        weakref.finalize(self, stream.free, gid)


class _ServerAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, query: Any, key: Any, value: Any, mask: Any, dropout_p: float, is_causal: bool, scale: Any, gqa: bool
    ) -> Any:
        from .stream import new_id
        from .tensor import record_call

        needs = tuple(bool(n) for n in ctx.needs_input_grad[:4])
        expected = _output(query, key, value, mask, dropout_p, is_causal, scale, gqa)
        gid = new_id() if any(needs) else None
        (out,), stream = record_call(
            "sdpa",
            (query, key, value, mask),
            {
                "dropout_p": dropout_p,
                "is_causal": is_causal,
                "scale": scale,
                "enable_gqa": gqa,
                "graph": gid,
                "needs": needs,
            },
            [expected],
        )
        if gid is not None:
            ctx.graph = _Graph(stream, gid)
            ctx.inputs = [_meta(t) if n else None for t, n in zip((query, key, value, mask), needs, strict=True)]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Any) -> Any:
        from .tensor import record_call

        grads, _ = record_call("sdpa_backward", (ctx.graph.id, grad_out), {}, ctx.inputs)
        return (*grads, None, None, None, None)


def _attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Any = None,
    enable_gqa: bool = False,
) -> Any:
    from .tensor import RemoteTensor

    if type(query) is not RemoteTensor:  # a fake tensor of the device, while torch.compile traces
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    return _ServerAttention.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def register() -> None:
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("scaled_dot_product_attention", _attention, "AutogradPrivateUse1")
