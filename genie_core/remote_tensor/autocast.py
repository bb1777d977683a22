"""`torch.autocast("remote_accelerator", dtype=...)`: the server device's own autocast policy.

PyTorch's autocast kernels (which ops run in lower precision, which in float32, which promote)
exist per device type and only act on tensors of that device. Here, for each op reaching the
`AutocastPrivateUse1` key, the policy of the server's device type (CPU or CUDA) is read from the
client's torch (the server's too, where the releases match) by running that device type's real
autocast kernel on data-less probe tensors of that
device type, below autograd: the probes note the casts it makes and the call it then makes (the
same op, or another overload or argument: CUDA runs `log_softmax` with `dtype=float32`, and `norm`
with a dtype appended, instead of casting). That plan is applied to the remote tensors and
recorded like any other op, so the server runs what its own autocast would, and shapes and dtypes
stay known here.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

_AUTOCAST = torch._C.DispatchKey.AutocastPrivateUse1  # type: ignore[attr-defined]  # not in torch's stubs
_EXCLUDE = torch._C.DispatchKeySet(_AUTOCAST)
aten = torch.ops.aten
# What an autocast kernel casts an argument with (`cached_cast`: `.to(dtype)`)
_CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default})
_plans: dict[Any, Plan | str | None] = {}
_lib: Any = None


class Slot(NamedTuple):
    """An argument of the autocast kernel's call: the op's leaf argument at `leaf` (as cast)."""

    leaf: int


class Plan(NamedTuple):
    """What the device's autocast kernel does with an op's arguments: the dtype it casts each leaf
    argument to (None: left as it is), then the call it makes, its tensors as `Slot`s."""

    casts: tuple[torch.dtype | None, ...]
    op: Any
    args: tuple
    kwargs: dict


class _Stop(Exception):
    """The autocast kernel has made its call: the plan is known."""


class _Probe(torch.Tensor):
    """A data-less tensor of the server's device type standing for one leaf argument (`slot`), that
    notes what the autocast kernel does with it in `seen`."""

    _slot: int
    _seen: dict[str, Any]

    @staticmethod
    def __new__(cls, like: Any, device: str, slot: int, seen: dict[str, Any], dtype: Any = None):
        p = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=dtype or like.dtype, device=torch.device(device)
        )
        p._slot, p._seen = slot, seen
        return p

    # PyTorch's own idiom for a subclass without __torch_function__ (typed unlike Tensor's classmethod)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from .tensor import _map

        kwargs = kwargs or {}
        src = args[0] if args else None
        target = kwargs.get("dtype", args[1] if func is aten.to.dtype and len(args) > 1 else None)
        if func in _CASTS and isinstance(src, _Probe) and isinstance(target, torch.dtype):
            src._seen["casts"][src._slot] = target
            return _Probe(src, src.device.type, src._slot, src._seen, dtype=target)
        call_args, call_kwargs = _map(lambda a: Slot(a._slot) if isinstance(a, _Probe) else a, args, kwargs)
        next(iter(_probes_of(args, kwargs)))._seen["call"] = (func, call_args, call_kwargs)
        raise _Stop


def _probes_of(args: tuple, kwargs: dict) -> list[_Probe]:
    from .tensor import _leaves

    return [a for a in _leaves(args, kwargs) if isinstance(a, _Probe)]


def _server_device_type() -> str:
    from .connection import server_device_type

    return server_device_type()


_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd
_disable_current_modes = torch.utils._python_dispatch._disable_current_modes


_NO_KERNEL = "no kernel"  # the device's autocast has no kernel for the op: it falls through


def plan(op: Any, args: tuple, kwargs: dict, device: str, dtype: torch.dtype) -> Plan | str | None:
    """What `device`'s autocast to `dtype` does with this call: a Plan; None where it has a kernel
    that changes nothing; _NO_KERNEL. Read from the running torch once per op and arguments
    (tensors by dtype)."""
    from .tensor import _leaves, typed_key

    leaves = _leaves(args, kwargs)
    try:
        key: Any = (
            op,
            device,
            dtype,
            tuple(a.dtype if isinstance(a, torch.Tensor) else typed_key(a) for a in leaves),
            tuple(kwargs),
        )
        return _plans[key]
    except KeyError:
        pass
    except TypeError:  # something unhashable among the arguments: no caching
        key = None
    found: Plan | str | None = _NO_KERNEL
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "AutocastCUDA" if device == "cuda" else "AutocastCPU"):
        found = _probe(op, args, kwargs, leaves, device, dtype)
    if key is not None:
        if len(_plans) > 50_000:  # (a number that changes each step makes a key each step)
            _plans.clear()
        _plans[key] = found
    return found


def _probe(op: Any, args: tuple, kwargs: dict, leaves: list[Any], device: str, dtype: torch.dtype) -> Plan | None:
    """Run the device's autocast kernel of `op` on probes: the casts it makes and the call it then
    makes, or None where that is the op as it was called."""
    from .tensor import _map

    seen: dict[str, Any] = {"casts": {}, "call": None}
    slots = iter(range(len(leaves)))

    def probe(a: Any) -> Any:
        index = next(slots)
        return _Probe(a, device, index, seen) if isinstance(a, torch.Tensor) else a

    probe_args, probe_kwargs = _map(probe, args, kwargs)
    was_on, was_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, dtype)
    try:
        # below autograd, so that the kernel's own call reaches the probes whole, not decomposed;
        # without the modes of whoever called (a fake tensor mode while Dynamo traces)
        with _BELOW_AUTOGRAD(), _disable_current_modes():
            op(*probe_args, **probe_kwargs)
    except _Stop:
        pass
    finally:
        torch.set_autocast_enabled(device, was_on)
        torch.set_autocast_dtype(device, was_dtype)
    if seen["call"] is None:
        return None
    call, call_args, call_kwargs = seen["call"]
    casts = tuple(seen["casts"].get(i) for i in range(len(leaves)))
    if any(casts) or call is not op or (call_args, call_kwargs) != _map(_as_slot(leaves), args, kwargs):
        return Plan(casts, call, call_args, call_kwargs)
    return None


def _as_slot(leaves: list[Any]) -> Any:
    """The arguments as a plan that changes nothing would give them (tensors as their slots)."""
    positions = {id(a): i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)}

    def slot(a: Any) -> Any:
        return Slot(positions[id(a)]) if isinstance(a, torch.Tensor) else a

    return slot


def _kernel(op: Any, keyset: Any, *args: Any, **kwargs: Any) -> Any:
    """The AutocastPrivateUse1 kernel: do what the server's autocast would. As in PyTorch's own
    kernels, what the op calls in turn is not cast again; an op the server's device type has no
    kernel for passes through, and what it calls in turn is."""
    from .tensor import _leaves, _map

    leaves = _leaves(args, kwargs)
    found: Plan | str | None = _NO_KERNEL
    if any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in leaves):
        found = plan(op, args, kwargs, _server_device_type(), torch.get_autocast_dtype("remote_accelerator"))
    if found is _NO_KERNEL:
        return op.redispatch(keyset.remove(_AUTOCAST), *args, **kwargs)
    with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
        if not isinstance(found, Plan):
            return op(*args, **kwargs)
        values = [
            a.to(cast) if cast is not None and isinstance(a, torch.Tensor) else a
            for a, cast in zip(leaves, found.casts, strict=True)
        ]

        def fill(a: Any) -> Any:
            return values[a.leaf] if type(a) is Slot else a

        call_args, call_kwargs = _map(fill, found.args, found.kwargs)
        return found.op(*call_args, **call_kwargs)


def supported_dtypes() -> list[torch.dtype]:
    """What `torch.autocast("remote_accelerator", dtype=...)` accepts: what the server's device type does."""
    return [torch.float16, torch.bfloat16, torch.float32]


def register() -> None:
    """A kernel at AutocastPrivateUse1 for each op that CPU or CUDA autocast handles (Python
    fallbacks cannot be registered for this key in torch 2.13); other ops fall through."""
    global _lib, _fallthrough
    _lib = torch.library.Library("aten", "IMPL")
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not any(
            torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in ("AutocastCPU", "AutocastCUDA")
        ):
            continue
        packet, _, overload = name.removeprefix("aten::").partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        _lib.impl(name.removeprefix("aten::"), functools.partial(_kernel, op), "AutocastPrivateUse1", with_keyset=True)
    _fallthrough = torch.library.Library("_", "IMPL")
    _fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")


_fallthrough: Any = None
