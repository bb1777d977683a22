"""Ops that write memory their other arguments read, judged at the op as the CPU and CUDA judge
them: `x[1:] = x[:-1]`, `torch.add(x[:-1], 1, out=x[1:])`, `x[:1].expand(3).exp_()`. PyTorch's
kernels refuse such overlap ("unsupported operation: some elements of the input tensor and the
written-to tensor refer to a single memory location"); its meta kernels cannot see it (meta
tensors have no memory). Recorded, the op would fail on the server at a later read and take its
target with it. So an op whose written tensor may overlap another argument, or itself, is judged
here: by the CPU's kernel on stand-ins that share memory as the arguments do (small ones), or by
the server's at once (its error at the op, its target kept). Which tensors may overlap follows
PyTorch's own rules (a written tensor with a zero stride; two dense tensors in one storage whose
bytes meet)."""

from __future__ import annotations

from typing import Any

import torch

from . import refusals

_JUDGED = object()  # the first item of a verdict's key in the meta cache (no op's key starts with it)


def written(func: Any) -> tuple[tuple[int, str], ...] | None:
    """The positions and names of the arguments an op writes (its schema's `Tensor(a!)`), or None
    for an op that writes none: worked out once per op (dispatch keeps it)."""
    found = tuple(
        (i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )
    return found or None


def suspected(writes: tuple[tuple[int, str], ...], args: tuple, kwargs: dict, remote: type) -> tuple | None:
    """How the arguments share memory (a group number per argument, lists flattened; None for
    what is not a remote tensor), where a written tensor may overlap another argument or itself as
    PyTorch's kernels judge it; None where none can. (Asked where `may_overlap`; one pass, however
    long the lists of a foreach op.)"""
    flat, targets = _tensors(writes, args, kwargs, remote)
    members: dict[int, list[int]] = {}  # a storage -> the positions of the arguments that name it
    for j, a in enumerate(flat):
        if a is not None:
            members.setdefault(id(_storage(a)), []).append(j)
    if not any(_overlaps(w, i, flat, members[id(_storage(w))]) for i, w in targets):
        return None
    groups = {name: number for number, name in enumerate(members)}
    return tuple(None if a is None else groups[id(_storage(a))] for a in flat)


def may_overlap(writes: tuple[tuple[int, str], ...], args: tuple, kwargs: dict, remote: Any) -> bool:
    """Whether a written tensor is expanded, or shares its storage with another argument (the same
    tensor twice, or a view: storages.py names a tensor's storage once a view of it is made). The
    common case, no, in well under a microsecond."""
    for position, name in writes:
        w: Any = args[position] if position < len(args) else kwargs.get(name)
        if type(w) is not remote:
            if type(w) in (list, tuple) and _list_may_overlap(w, args, kwargs, remote):
                return True
            continue
        if w._layout.expanded:
            return True
        shared = w.__dict__.get("_shared")
        seen = 0
        for a in (*args, *kwargs.values()) if kwargs else args:
            if a is w:
                seen += 1
            elif shared is not None and (
                (type(a) is remote and a.__dict__.get("_shared") is shared) or type(a) in (list, tuple)
            ):
                return True
        if seen > 1:
            return True
    return False


def _list_may_overlap(written: Any, args: tuple, kwargs: dict, remote: Any) -> bool:
    """may_overlap for a written list (a foreach op's): a pass over the arguments."""
    names = set()
    for x in written:
        if type(x) is remote:
            if x._layout.expanded or x.__dict__.get("_shared") is not None:
                return True
            names.add(id(x))
    found = 0
    for a in (*args, *kwargs.values()):
        for x in a if type(a) in (list, tuple) else (a,):
            found += id(x) in names
    return found > len(names)  # (one of them twice)


def _overlaps(w: Any, position: int, flat: list[Any], same_storage: list[int]) -> bool:
    """Whether written tensor `w` (at `position`) may overlap itself or another argument of its
    storage (at `same_storage`)."""
    return w._layout.expanded or any(j != position and _meet(w._layout, flat[j]._layout) for j in same_storage)


def _storage(a: Any) -> Any:
    """What names a remote tensor's storage here: its shared storage, or itself when no view of it
    was made (storages.py)."""
    shared = a.__dict__.get("_shared")
    return a if shared is None else shared


def refused(func: Any, args: tuple, kwargs: dict, pattern: tuple, budget: int) -> bool | None:
    """Whether the CPU's kernel refuses the op on stand-ins laid out and sharing memory as the
    arguments do (`pattern`: suspected's), with zeros and then ones in them (both must be refused:
    a refusal that depends on the values is not the overlap's); None where it cannot be asked
    (stand-ins past `budget` bytes, a custom op, LAPACK's)."""
    verdicts = [
        refusals.verdict_on(func, *_stand_ins(args, kwargs, pattern, fill, budget))
        for fill in ((torch.zeros, torch.ones), (torch.ones, torch.ones))
    ]
    if any(v is None for v in verdicts):
        return None
    return all(isinstance(v, Exception) for v in verdicts)


def key(info: Any, sig: list[Any], kwargs: dict, pattern: tuple) -> tuple:
    """The meta-cache key of a verdict: the op, its signature (layouts) and how its arguments share
    memory."""
    return (_JUDGED, info, *sig, *kwargs, pattern)


def _tensors(
    writes: tuple[tuple[int, str], ...], args: tuple, kwargs: dict, remote: type
) -> tuple[list[Any], list[tuple[int, Any]]]:
    """The arguments, lists flattened, each a remote tensor or None, and the written ones among
    them with their positions."""
    positions, names = {p for p, _ in writes}, {n for _, n in writes}
    flat: list[Any] = []
    targets: list[tuple[int, Any]] = []
    for index, (name, a) in enumerate((*enumerate(args), *kwargs.items())):
        target = name in positions if index < len(args) else name in names
        for x in a if type(a) in (list, tuple) else (a,):
            if target and type(x) is remote:
                targets.append((len(flat), x))
            flat.append(x if type(x) is remote else None)
    return flat, targets


def _dense(layout: Any) -> bool:
    """PyTorch's `is_non_overlapping_and_dense`: its elements fill a span, each byte once."""
    expected = 1
    for n, s in sorted(((n, abs(s)) for n, s in zip(layout.shape, layout.stride, strict=True) if n != 1), key=_stride):
        if s != expected:
            return False
        expected *= n
    return True


def _stride(pair: tuple[int, int]) -> int:
    return pair[1]


def _meet(a: Any, b: Any) -> bool:
    """Whether two tensors in one storage may overlap as PyTorch's kernels judge it: both dense and
    their bytes meet (PyTorch does not judge the rest)."""
    if 0 in a.shape or 0 in b.shape or not (_dense(a) and _dense(b)):
        return False
    start_a, end_a = _span(a)
    start_b, end_b = _span(b)
    return start_a < end_b and start_b < end_a


def _span(layout: Any) -> tuple[int, int]:
    size = layout.dtype.itemsize
    start = layout.offset * size
    count = 1
    for n in layout.shape:
        count *= n
    return start, start + count * size


def _stand_ins(args: tuple, kwargs: dict, pattern: tuple, fill: tuple[Any, Any], budget: int) -> tuple[Any, Any]:
    """CPU stand-ins of the arguments: those `pattern` groups share one buffer, laid out in it as
    they are in their storage; the rest as refusals makes them. (None, None) past `budget` bytes."""
    members: dict[int, list[Any]] = {}
    positions = iter(range(len(pattern)))
    buffers: dict[int, torch.Tensor] = {}
    for a in (*args, *kwargs.values()):
        for x in a if type(a) in (list, tuple) else (a,):
            group = pattern[next(positions)]
            if group is not None:
                members.setdefault(group, []).append(x)
    for group, tensors in members.items():
        nbytes = max(_reach(t._layout) for t in tensors)
        budget -= nbytes
        if budget < 0:
            return None, None
        first = tensors[0]
        make = fill[1] if first.is_floating_point() or first.is_complex() else fill[0]
        size = first.element_size()
        buffers[group] = make(-(-nbytes // size), dtype=first.dtype)
    left = [budget]
    positions = iter(range(len(pattern)))

    def one(x: Any) -> Any:
        group = pattern[next(positions)]
        if group is None:
            return refusals.stand_in(x, left, fill)
        base = buffers[group]
        made = torch.empty(0, dtype=x.dtype).set_(base.untyped_storage(), x.storage_offset(), x.shape, x.stride())
        return made.conj() if x.is_conj() else made

    def each(a: Any) -> Any:
        if type(a) in (list, tuple):
            return type(a)(one(x) for x in a)
        return one(a)

    try:
        cpu_args = tuple(each(a) for a in args)
        cpu_kwargs = {k: each(v) for k, v in kwargs.items()}
    except refusals.NoStandIn:
        return None, None
    return cpu_args, cpu_kwargs


def _reach(layout: Any) -> int:
    """Bytes from the storage's start to the end of the layout's last element."""
    last = layout.offset + sum((n - 1) * abs(s) for n, s in zip(layout.shape, layout.stride, strict=True) if n)
    return (last + 1) * layout.dtype.itemsize
