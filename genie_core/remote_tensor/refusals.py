"""Ops PyTorch's meta kernels take or refuse otherwise than the device kernels, judged by the
CPU's kernel on stand-ins of the arguments (same shapes, strides and dtypes; ones, and zeros for
integers, which index anything).

- Refused by the meta kernel: its checks are the kernels', but not always in their words or of
  their type (`clamp()` with no bounds: a ValueError where the kernels raise a RuntimeError;
  `int_tensor.add_(0.5)`). The CPU kernel's error is raised instead, here, with no round trip;
  where the CPU kernel takes the arguments (a meta kernel stricter than the kernels: `abs` of a
  complex tensor into a complex `out=`), the op runs on the server at once.
- Taken by the meta kernel, refused by the kernels: the dtypes a kernel has no code for
  (`bool_tensor.abs_()`, `maximum` of complex tensors), dtype checks the meta kernels skip
  (`sub` of bools, `float_tensor.add_(1j)`). Recorded, such an op failed on the server at a later
  read, and marked what it writes failed (its values not known): a typo lost the tensor. On a
  server that computes on the CPU, where the arguments are small (SMALL_BYTES), the CPU kernel is
  asked on stand-ins once per signature; if it refuses, the server's kernel answers at the op (its
  own error, which leaves the op's targets as the kernel left them, as on the CPU; or, where it
  takes what the stand-ins lacked, a value, its outputs, cached). A result its target cannot hold
  (`narrowing`) is refused at the op whatever the sizes and the server."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .connection import DEVICE_TYPE

TAKEN = object()  # the CPU's kernel takes the arguments
STAND_IN_BYTES = 64 << 20  # past this, stand-ins cost more than the words: the meta kernel's error stays
SMALL_BYTES = 64 << 10  # arguments and outputs this small are asked about an op the meta kernel takes


def refused_on_the_cpu(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether the CPU's kernel refuses small arguments that the meta kernel took (`out`: its
    outputs). Asked once per op, layout of its tensors and value of its other arguments (a number's
    range is checked: `random_(from, to)`), as the meta cache is keyed."""
    outs = out if type(out) in (tuple, list) else (out,)
    made = sum(m.numel() * m.element_size() for m in outs if isinstance(m, torch.Tensor))
    if made > SMALL_BYTES:
        return False
    try:
        key: Any = (func, *map(_layout, args), *((k, _layout(v)) for k, v in kwargs.items()))
        known = _refused.get(key)
    except TypeError:  # (something unhashable)
        key, known = None, None
    if known is None:
        known = isinstance(cpu_verdict(func, args, kwargs, SMALL_BYTES - made), Exception)
        if key is not None:
            if len(_refused) > 10_000:
                _refused.clear()
            _refused[key] = known
    return known


_refused: dict[Any, bool] = {}


def _layout(a: Any) -> Any:
    if type(a) in (list, tuple):
        return tuple(map(_layout, a))
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.stride(), a.storage_offset(), a.is_conj())
    return (type(a), a) if type(a) in (float, complex, bool) else a  # (1, 1.0 and True: equal keys)


def cpu_verdict(func: Any, args: tuple, kwargs: dict, budget_bytes: int = STAND_IN_BYTES) -> Any:
    """The CPU kernel's error for these arguments, TAKEN, or None where it cannot be asked (a
    custom op, which may act; stand-ins past `budget_bytes`; an argument with no CPU stand-in)."""
    if func.namespace not in ("aten", "prims"):
        return None
    budget = [budget_bytes]
    try:
        cpu_args = tuple(_stand_in(a, budget) for a in args)
        cpu_kwargs = {k: _stand_in(v, budget) for k, v in kwargs.items()}
    except _NoStandIn:
        return None
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # (the CPU's generator left as it was)
        warnings.simplefilter("ignore")
        try:
            func(*cpu_args, **cpu_kwargs)
        except Exception as exc:
            return exc
    return TAKEN


def narrowing(func: Any, margs: tuple, mkwargs: dict, out: Any) -> bool:
    """Whether an in-place op's result has a dtype its target cannot hold (`float.add_(1j)`,
    `int.sqrt_()`): the kernels refuse it at the op (their result type cannot be cast), PyTorch's
    meta kernels of some (`add_`, `mul_`) take it. Judged by the op's out-of-place form on meta."""
    name = func._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_") or not isinstance(out, torch.Tensor):
        return False
    packet = getattr(getattr(torch.ops, func.namespace), name[:-1], None)
    functional = getattr(packet, func._overloadname, None) if packet is not None else None
    if functional is None:
        return False
    try:
        made = functional(*margs, **mkwargs)
    except Exception:
        return False
    return isinstance(made, torch.Tensor) and not torch.can_cast(made.dtype, out.dtype)


class _NoStandIn(Exception):
    pass


def _stand_in(a: Any, budget: list[int]) -> Any:
    if type(a) in (list, tuple):
        return type(a)(_stand_in(x, budget) for x in a)
    if isinstance(a, torch.UntypedStorage):
        raise _NoStandIn
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided:
            raise _NoStandIn
        span = int(
            1 + a.storage_offset() + sum((n - 1) * abs(s) for n, s in zip(a.shape, a.stride(), strict=True) if n)
        )
        budget[0] -= span * a.element_size()
        if budget[0] < 0:
            raise _NoStandIn
        fill = torch.zeros if not (a.is_floating_point() or a.is_complex()) else torch.ones
        t = fill(span, dtype=a.dtype).as_strided(a.shape, a.stride(), a.storage_offset())
        return t.conj() if a.is_conj() else t
    if (isinstance(a, torch.device) and a.type != "cpu") or (type(a) is str and a.startswith(DEVICE_TYPE)):
        return torch.device("cpu")
    return a
