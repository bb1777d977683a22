"""`torch.autocast("remote_accelerator", dtype=...)`: the server device's own autocast policy.

PyTorch's autocast kernels (which ops run in lower precision, which in float32, which promote)
exist per device type and only cast tensors of that device. Here, for each op reaching the
`AutocastPrivateUse1` key, the policy of the server's device type (CPU or CUDA) is read by
running the op's real autocast kernel on data-less probe tensors of that device; the casts it
asks for are applied to the remote tensors and recorded like any other op. The server thus
runs exactly the casts its own autocast would, and shapes and dtypes stay known locally.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)  # type: ignore[attr-defined]  # not in torch's stubs
_plans: dict[Any, tuple[Any, ...]] = {}
_lib: Any = None


class _Stop(Exception):
    """The autocast kernel has cast its arguments and moved on: the plan is known."""


class _Probe(torch.Tensor):
    """A data-less tensor of the server's device type, that notes the casts made of it."""

    _slot: int | None
    _casts: dict[int, torch.dtype]

    @staticmethod
    def __new__(cls, like: torch.Tensor, device: str, slot: int | None, casts: dict[int, torch.dtype]):
        p = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=torch.device(device)
        )
        p._slot, p._casts = slot, casts
        return p

    # PyTorch's own idiom for a subclass without __torch_function__ (typed unlike Tensor's classmethod)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if (
            func is torch.ops.aten._to_copy.default
            and isinstance(src, _Probe)
            and src._slot is not None
            and "dtype" in kwargs
        ):
            src._casts[src._slot] = kwargs["dtype"]
            return _Probe(src, src.device.type, None, src._casts)
        raise _Stop


def _server_device_type() -> str:
    from .connection import server_device_type

    return server_device_type()


def _plan(op: Any, args: tuple, kwargs: dict, leaves: list[Any], device: str, dtype: torch.dtype) -> tuple[Any, ...]:
    """For each leaf argument, the dtype the server's autocast would cast it to (or None)."""
    from .tensor import _map

    key = (op, device, dtype, tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in leaves))
    plan = _plans.get(key)
    if plan is not None:
        return plan
    autocast_key = "AutocastCUDA" if device == "cuda" else "AutocastCPU"
    casts: dict[int, torch.dtype] = {}
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), autocast_key):
        slots = iter(range(len(leaves)))

        def probe(a: Any) -> Any:
            slot = next(slots)
            return _Probe(a, device, slot, casts) if isinstance(a, torch.Tensor) else a

        args, kwargs = _map(probe, args, kwargs)
        was_on, was_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        torch.set_autocast_enabled(device, True)
        torch.set_autocast_dtype(device, dtype)
        try:
            op(*args, **kwargs)
        except _Stop:
            pass
        finally:
            torch.set_autocast_enabled(device, was_on)
            torch.set_autocast_dtype(device, was_dtype)
    plan = tuple(casts.get(i) for i in range(len(leaves)))
    _plans[key] = plan
    return plan


def _kernel(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The AutocastPrivateUse1 kernel: cast as the server's autocast would, then run the op."""
    from .tensor import _leaves, _map

    device = _server_device_type()
    dtype = torch.get_autocast_dtype("remote_accelerator")
    leaves = _leaves(args, kwargs)
    with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
        if any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in leaves):
            plan = _plan(op, args, kwargs, leaves, device, dtype)
            if any(plan):
                casts = iter(plan)

                def cast(a: Any) -> Any:
                    target = next(casts)
                    return a.to(target) if target is not None and isinstance(a, torch.Tensor) else a

                args, kwargs = _map(cast, args, kwargs)
        return op(*args, **kwargs)


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
        _lib.impl(name.removeprefix("aten::"), functools.partial(_kernel, op), "AutocastPrivateUse1")
    _fallthrough = torch.library.Library("_", "IMPL")
    _fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")


_fallthrough: Any = None
