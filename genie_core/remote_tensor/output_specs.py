"""What an op makes, worked out once per signature on the client: the layouts remote tensors
carry (interned), which outputs are written-to arguments, what the server must find in each
output, and the meta-cache entry (OutputSpec) that holds them for one op signature."""

from __future__ import annotations

import math
from operator import itemgetter
from typing import Any, TypeAlias

import torch

from ..protocol.op_records import Expects

_alias_cache: dict[Any, dict[int, Any]] = {}  # op -> {output position: the argument it writes}


CONJUGATE, NEGATIVE = 1, 2  # a layout's `bits`: a lazily conjugated or negated view


class Layout:
    """A remote tensor's dtype, shape, strides and offset, and whether it is a conjugate or negative
    view (`bits`: a view op's output keeps them, as its meta kernel says), interned: equal layouts
    are one object, which the meta-shape cache hashes and compares by identity (reading them off a
    tensor costs four calls into PyTorch per argument per op)."""

    __slots__ = ("bits", "dense", "dtype", "expanded", "nbytes", "offset", "shape", "stride")

    def __init__(self, dtype: Any, shape: tuple, stride: tuple, offset: int, bits: int) -> None:
        self.dtype, self.shape, self.stride, self.offset, self.bits = dtype, shape, stride, offset, bits
        # what overlaps.py asks, worked out once per layout: its elements' bytes, whether some share
        # memory (a zero stride on a dimension of more than one: `expand`), and whether they fill a
        # span each byte once (PyTorch's `is_non_overlapping_and_dense`; an empty tensor is not)
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.expanded = 0 not in shape and any(n > 1 and s == 0 for n, s in zip(shape, stride, strict=True))
        self.dense = self.nbytes > 0 and _fills_a_span(shape, stride)


def _fills_a_span(shape: tuple, stride: tuple) -> bool:
    expected = 1
    for n, s in sorted(((n, abs(s)) for n, s in zip(shape, stride, strict=True) if n != 1), key=itemgetter(1)):
        if s != expected:
            return False
        expected *= n
    return True


_layouts: dict[tuple, Layout] = {}


def layout_of(dtype: Any, shape: Any, stride: Any, offset: int, bits: int = 0) -> Layout:
    key = (dtype, tuple(shape), tuple(stride), offset, bits)
    found = _layouts.get(key)
    if found is None:
        if len(_layouts) > 200_000:  # (tensors keep theirs; equal new ones then miss the cache once)
            _layouts.clear()
        found = _layouts[key] = Layout(*key)
    return found


# What makes one fresh output tensor: shape, strides, offset, dtype, and its interned Layout.
Made: TypeAlias = tuple[tuple[int, ...], tuple[int, ...], int, Any, Layout]


class OutputSpec:
    """A meta-cache entry: what an op with one signature makes on the server's device type."""

    __slots__ = ("aliases", "expect", "made", "metas", "op", "plain", "verified")

    def __init__(self, out: Any, func: Any) -> None:
        self.op = str(func)
        self.metas = out  # the outputs' metadata, as meta tensors (or plain values)
        self.aliases = aliases(func)  # output position -> the argument it writes (in-place, out=)
        self.expect: Expects = expectations(out)  # what the server must find in each output
        outs = out if type(out) in (tuple, list) else (out,)
        # fresh outputs only, no conjugate or negative views
        self.plain = not self.aliases and not any(
            isinstance(m, torch.Tensor) and (m.is_conj() or m.is_neg()) for m in outs
        )
        self.made: Made | None = None  # one fresh tensor out: what makes it (the hot path)
        if isinstance(out, torch.Tensor) and self.plain:
            shape, stride, offset = tuple(out.shape), tuple(out.stride()), int(out.storage_offset())
            self.made = (shape, stride, offset, out.dtype, layout_of(out.dtype, shape, stride, offset))
        # the stream's generation in which the server made these outputs exactly as expected, for
        # these inputs (OpStream.checks): uses in the same generation are not checked again; -1: none
        self.verified = -1


def aliases(func: Any) -> dict[int, Any]:
    """Which outputs are written-to arguments (in-place and out= ops), from the op's schema."""
    found = _alias_cache.get(func)
    if found is None:
        found = {}
        schema = func._schema
        for i, ret in enumerate(schema.returns):
            info = ret.alias_info
            if info is None or not info.is_write:
                continue
            for pos, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.before_set == info.before_set:
                    found[i] = ("kw", arg.name) if arg.kwarg_only else ("pos", pos, arg.name)
                    break
        _alias_cache[func] = found
    return found


def expectations(out: Any) -> Expects:
    """What the server must find in each output (shape, strides, offset, dtype): a meta kernel that
    disagrees with the device's kernel then fails the op instead of giving a wrong result."""
    outs = out if type(out) in (tuple, list) else (out,)
    return tuple(
        (tuple(m.shape), tuple(m.stride()), int(m.storage_offset()), m.dtype) if isinstance(m, torch.Tensor) else None
        for m in outs
    )
