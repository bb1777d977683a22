"""Ops PyTorch's meta kernels judge otherwise than the device's kernels, judged by the CPU's
kernel on stand-ins of the arguments (same layouts and dtypes; ones, and zeros for integers).

- Refused by the meta kernel: its checks are the kernels', not always in their words or of their
  type (`clamp()` with no bounds: a ValueError, where the kernels raise a RuntimeError). The CPU
  kernel's error is raised instead, with no round trip; where it takes the arguments (a meta
  kernel stricter than the kernels), the server's kernel answers, once per signature.
- Taken by the meta kernel, refused by the kernels (a dtype a kernel has no code for,
  `bool_tensor.abs_()`; dtype checks the meta kernel skips, `sub_` of a bool). Recorded, such an
  op would fail on the server at a later read and mark its target failed. Small arguments
  (SMALL_BYTES) are asked about once per signature; refused, the op runs on the server at once
  (whose kernel answers: a GPU's, or another torch's, may take it). A result an in-place target
  cannot hold (`narrowing`) is asked about on one-element stand-ins, whatever the sizes and the
  server."""

from __future__ import annotations

from typing import Any

import torch

from .connection import DEVICE_TYPE

TAKEN = object()  # the CPU's kernel takes the arguments
STAND_IN_BYTES = 64 << 20  # past this, stand-ins cost more than the words: the meta kernel's error stays
SMALL_BYTES = 64 << 10  # arguments and outputs this small are asked about an op the meta kernel takes


def refused_on_the_cpu(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether the CPU's kernel refuses small arguments that the meta kernel took (`out`: its
    outputs), on stand-ins of zeros for integers and then of ones (`a // b`). Asked on a meta-cache
    miss, so once per signature (a number by value: its range is checked, `random_(from, to)`): the
    signature is then cached, or learned from the server. Not asked of views (a stand-in holds
    only the view's elements)."""
    outs = out if type(out) in (tuple, list) else (out,)
    made = sum(m.numel() * m.element_size() for m in outs if isinstance(m, torch.Tensor))
    if made > SMALL_BYTES or _is_view(func):
        return False
    return all(
        isinstance(cpu_verdict(func, args, kwargs, SMALL_BYTES - made, integers=fill), Exception)
        for fill in (torch.zeros, torch.ones)
    )


def as_the_server_would(verdict: Any, device_kind: str) -> Any:
    """The verdict, where a server of `device_kind` would give it: not the CPU's lack of a kernel
    (for the op, or for a dtype: a NotImplementedError) on a GPU server, which has kernels the CPU
    lacks (there, None: not known here)."""
    return None if isinstance(verdict, NotImplementedError) and device_kind != "cpu" else verdict


def _trusts_its_data(func: Any) -> bool:
    """LAPACK's ops, which take pivots and factors as they come: on stand-ins, torch 2.11's
    `linalg_ldl_solve` aborts the process."""
    name = func._schema.name.split("::")[-1]
    return "linalg" in name or any("pivots" in a.name or a.name in ("LU", "LD") for a in func._schema.arguments)


def _is_view(func: Any) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def cpu_verdict(
    func: Any, args: tuple, kwargs: dict, budget: int = STAND_IN_BYTES, *, integers: Any = None, tiny: bool = False
) -> Any:
    """The CPU kernel's error for these arguments, TAKEN, or None where it cannot be asked (a
    custom op, which may act; stand-ins past `budget` bytes; an argument with no CPU stand-in).
    `tiny`: a tensor of one element each (a verdict on dtypes)."""
    fill, left = (integers or torch.zeros, torch.ones), [budget]
    try:
        cpu_args = tuple(stand_in(a, left, fill, tiny) for a in args)
        cpu_kwargs = {k: stand_in(v, left, fill, tiny) for k, v in kwargs.items()}
    except NoStandIn:
        return None
    return verdict_on(func, cpu_args, cpu_kwargs)


def verdict_on(func: Any, cpu_args: Any, cpu_kwargs: Any) -> Any:
    """The CPU kernel's error on these CPU arguments, TAKEN, or None where it is not asked (no
    arguments: no stand-ins; a custom op, which may act; LAPACK's, see _trusts_its_data)."""
    if cpu_args is None or func.namespace not in ("aten", "prims") or _trusts_its_data(func):
        return None
    seeded = torch.Tag.nondeterministic_seeded in func.tags
    with torch.random.fork_rng(devices=[], enabled=seeded):  # (a random op leaves the CPU's generator as it was)
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


class NoStandIn(Exception):
    """An argument with no CPU stand-in (a storage, a sparse tensor), or stand-ins past the budget."""


def stand_in(a: Any, budget: list[int], fill: tuple[Any, Any], tiny: bool = False) -> Any:
    """A CPU tensor laid out as `a`, of zeros or ones (`fill`: for integers and bools, and for the
    rest), or `a` itself where it is not a tensor (a remote device named: the CPU)."""
    if type(a) in (list, tuple):
        return type(a)(stand_in(x, budget, fill, tiny) for x in a)
    if isinstance(a, torch.UntypedStorage):
        raise NoStandIn
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided:
            raise NoStandIn
        make = fill[1] if a.is_floating_point() or a.is_complex() else fill[0]
        if tiny:
            t = make((1,) * a.dim(), dtype=a.dtype)
        else:
            span = int(
                1 + a.storage_offset() + sum((n - 1) * abs(s) for n, s in zip(a.shape, a.stride(), strict=True) if n)
            )
            budget[0] -= span * a.element_size()
            if budget[0] < 0:
                raise NoStandIn
            t = make(span, dtype=a.dtype).as_strided(a.shape, a.stride(), a.storage_offset())
        return t.conj() if a.is_conj() else t
    if (isinstance(a, torch.device) and a.type != "cpu") or (type(a) is str and a.startswith(DEVICE_TYPE)):
        return torch.device("cpu")
    return a
