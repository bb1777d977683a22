"""Ops that write memory their other arguments read, judged at the op as the CPU and CUDA judge
them: `x[1:] = x[:-1]`, `torch.add(x[:-1], 1, out=x[1:])`, `x[:1].expand(3).exp_()`. PyTorch's
kernels refuse such overlap ("unsupported operation: some elements of the input tensor and the
written-to tensor refer to a single memory location"); its meta kernels cannot see it (meta
tensors have no memory). Recorded, the op would fail on the server at a later read and take its
target with it. So an op whose written tensor may overlap another argument, or itself, is judged
here: by the CPU's kernel on stand-ins that share memory as the arguments do (small ones), or by
the server's at once (its error at the op, its target kept; taken, the op is recorded from then
on). Which tensors may overlap follows PyTorch's own rules (a written tensor with a zero stride;
the same tensor twice; two dense tensors in one storage whose bytes meet)."""

from __future__ import annotations

from typing import Any

import torch

from . import refusals

_JUDGED = object()  # the first item of a verdict's key in the meta cache (no op's key starts with it)


_METADATA_ONLY = frozenset({"aten::set_", "aten::resize_", "aten::resize_as_", "aten::_resize_output_"})


def written(func: Any) -> tuple[tuple[int, str], ...] | None:
    """The positions and names of the arguments an op writes (its schema's `Tensor(a!)`), or None
    for an op that writes none, or only a tensor's metadata (`t_`, `set_`, `resize_`: PyTorch
    judges no overlap there): worked out once per op (dispatch keeps it)."""
    schema = func._schema
    if torch.Tag.inplace_view in func.tags or schema.name in _METADATA_ONLY:
        return None
    found = tuple(
        (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )
    return found or None


def may_overlap(writes: tuple[tuple[int, str], ...], args: tuple, kwargs: dict, remote: Any) -> bool:
    """Whether a written tensor is expanded, or another argument names its storage (the same
    tensor again, or a view of it: storages.py names a tensor's storage once a view of it is made),
    in a list or not. The common case, no, in about a microsecond, on every op that writes."""
    written_storages = set()
    count = 0
    for position, name in writes:
        w: Any = args[position] if position < len(args) else kwargs.get(name)
        for x in w if type(w) in (list, tuple) else (w,):
            if type(x) is remote:
                if x._layout.expanded:
                    return True
                written_storages.add(id(x.__dict__.get("_shared") or x))
                count += 1
    if not count:
        return False
    if len(written_storages) < count:
        return True  # (two written tensors of one storage)
    seen = 0
    for a in (*args, *kwargs.values()) if kwargs else args:
        for x in a if type(a) in (list, tuple) else (a,):
            if type(x) is remote and id(x.__dict__.get("_shared") or x) in written_storages:
                seen += 1
    return seen > count


def suspected(writes: tuple[tuple[int, str], ...], args: tuple, kwargs: dict, remote: type) -> tuple | None:
    """How the arguments share memory, where a written tensor may overlap another argument or
    itself as PyTorch's kernels judge it (None where none can): for each argument (lists
    flattened), None if it is not a remote tensor, else its storage's number and the position
    where the same tensor first comes (one stand-in for both: PyTorch judges a tensor against
    itself whatever its layout). Asked where `may_overlap`; one pass, however long the lists."""
    flat, targets = _tensors(writes, args, kwargs, remote)
    members: dict[int, list[int]] = {}  # a storage -> the positions of the arguments that name it
    for j, a in enumerate(flat):
        if a is not None:
            members.setdefault(id(_storage(a)), []).append(j)
    if not any(_overlaps(w, i, flat, members[id(_storage(w))]) for i, w in targets):
        return None
    groups = {name: number for number, name in enumerate(members)}
    first: dict[int, int] = {}
    return tuple(
        None if a is None else (groups[id(_storage(a))], first.setdefault(id(a), j)) for j, a in enumerate(flat)
    )


def _overlaps(w: Any, position: int, flat: list[Any], same_storage: list[int]) -> bool:
    """Whether written tensor `w` (at `position`) may overlap itself or another argument of its
    storage (at `same_storage`): itself again, or a dense one whose bytes meet its own."""
    layout = w._layout
    return layout.expanded or any(
        j != position and (flat[j] is w or _meet(layout, flat[j]._layout)) for j in same_storage
    )


def _storage(a: Any) -> Any:
    """What names a remote tensor's storage here: its shared storage, or itself when no view of it
    was made (storages.py)."""
    shared = a.__dict__.get("_shared")
    return a if shared is None else shared


def refused(func: Any, args: tuple, kwargs: dict, pattern: tuple, device_kind: str) -> bool:
    """Whether the op is sent to the server at once: the CPU's kernel refuses it on stand-ins laid
    out and sharing memory as the arguments do (`pattern`: suspected's), with zeros and then ones
    in them (a refusal that depends on the values is not the overlap's), or cannot be asked
    (stand-ins past refusals.STAND_IN_BYTES, a custom op, LAPACK's, the CPU's lack of a kernel on a
    GPU server)."""
    for fill in ((torch.zeros, torch.ones), (torch.ones, torch.ones)):
        verdict = refusals.verdict_on(func, *_stand_ins(args, kwargs, pattern, fill, refusals.STAND_IN_BYTES))
        if refusals.as_the_server_would(verdict, device_kind) is refusals.TAKEN:
            return False
    return True


def key(info: Any, sig: list[Any], kwargs: dict, pattern: tuple) -> tuple:
    """The meta-cache key of an op taken with this sharing: the op, its signature (layouts) and
    how its arguments share memory."""
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


def _meet(a: Any, b: Any) -> bool:
    """Whether two tensors in one storage may overlap as PyTorch's kernels judge it: both dense
    (output_specs.Layout) and their bytes meet (PyTorch does not judge the rest)."""
    if not (a.dense and b.dense):
        return False
    start_a, start_b = a.offset * a.dtype.itemsize, b.offset * b.dtype.itemsize
    return start_a < start_b + b.nbytes and start_b < start_a + a.nbytes


def _stand_ins(args: tuple, kwargs: dict, pattern: tuple, fill: tuple[Any, Any], budget: int) -> tuple[Any, Any]:
    """CPU stand-ins of the arguments: those of one storage in `pattern` share one buffer, laid out
    in it as they are in their storage, the same tensor twice one stand-in; the rest as refusals
    makes them. (None, None) past `budget` bytes."""
    members: dict[int, list[Any]] = {}
    positions = iter(pattern)
    for a in (*args, *kwargs.values()):
        for x in a if type(a) in (list, tuple) else (a,):
            where = next(positions)
            if where is not None:
                members.setdefault(where[0], []).append(x)
    buffers: dict[int, torch.Tensor] = {}
    for group, tensors in members.items():
        nbytes = max(_reach(t._layout) for t in tensors)
        budget -= nbytes
        if budget < 0:
            return None, None
        first = tensors[0]
        make = fill[1] if first.is_floating_point() or first.is_complex() else fill[0]
        buffers[group] = make(-(-nbytes // first.element_size()), dtype=first.dtype)
    left, made = [budget], {}
    positions = iter(pattern)

    def one(x: Any) -> Any:
        where = next(positions)
        if where is None:
            return refusals.stand_in(x, left, fill)
        if where[1] not in made:
            t = torch.empty(0, dtype=x.dtype).set_(
                buffers[where[0]].untyped_storage(), x.storage_offset(), x.shape, x.stride()
            )
            made[where[1]] = t.conj() if x.is_conj() else t
        return made[where[1]]

    def each(a: Any) -> Any:
        return type(a)(one(x) for x in a) if type(a) in (list, tuple) else one(a)

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
