"""Whether an op's number arguments fit the dtype they are converted to.

PyTorch's kernels convert a `Scalar` argument to the tensor's element type with an overflow check
(`fill_(300)` on int8, `masked_fill(mask, -1e9)` on float16, a complex value into a real tensor)
and raise at the op; meta kernels do not, so here the error would come from the server at the
next read. An op whose number does not fit is judged by the CPU's kernel (refusals.py): its error
at the op, or, where the kernel takes the number (`leaky_relu` of float16 with a slope of 1e5),
the op recorded as any other."""

from __future__ import annotations

from typing import Any

import torch

_NUMBERS = (int, float, complex)  # (bool fits every dtype)


def fit(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether each number given for one of `func`'s `Scalar` parameters converts to the dtype of
    its (first) output without overflow, by PyTorch's own conversion rule (`fill_`'s)."""
    dtype = _first_dtype(out)
    if dtype is None:
        return True
    arguments = func._schema.arguments
    given = [(arguments[p], v) for p, v in enumerate(args[: len(arguments)])]
    given += [(a, kwargs[a.name]) for a in arguments if a.name in kwargs]
    return all(fits(v, dtype) for a, v in given if type(v) in _NUMBERS and _is_scalar(a))


def fits(value: complex, dtype: torch.dtype) -> bool:
    """Whether `value` converts to `dtype` as PyTorch's kernels convert a Scalar (c10's
    `checked_convert`: a finite value out of range, or an imaginary part into a real type, does
    not; -1 into uint8 does, as do inf and nan into a float type)."""
    try:
        check_fill(value, dtype)
    except Exception:  # (RuntimeError; OverflowError for a Python int past 64 bits)
        return False
    return True


def check_fill(value: Any, dtype: torch.dtype) -> None:
    """`torch.full(size, value, dtype=...)`: raised at the op in the CPU's words where it does not fit."""
    if type(value) in _NUMBERS:
        torch.empty(2, dtype=dtype).fill_(value)  # (not 0-dim: one element's fill skips the check for half types)


def _is_scalar(argument: Any) -> bool:
    kind = argument.type
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.NumberType)


def _first_dtype(out: Any) -> torch.dtype | None:
    for m in out if type(out) in (tuple, list) else (out,):
        if isinstance(m, torch.Tensor):
            return m.dtype
    return None
