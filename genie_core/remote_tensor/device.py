"""The `remote_accelerator` device: PyTorch's PrivateUse1 backend renamed, its device module
(`torch.remote_accelerator`, device_module.py), and the few factory kernels that creating tensors
needs."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from .after_import import after_import
from .connection import DEVICE_TYPE, set_client, stream_for
from .device_module import _DeviceModule

_registered = False
_lock = threading.Lock()


def _fake_mode() -> Any:
    """The fake tensor mode torch.compile traces under, if one is active. Tensors made on the device
    there (below the mode, as `torch.tensor(data, device=...)` makes them) are fake, never remote."""
    import torch

    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _factory_kernels(lib: Any) -> None:
    import torch

    from ..protocol.tensor_ops import RemoteDevice, encode_value
    from . import refusals, scalars
    from .output_specs import OutputSpec
    from .stream import refuse_over_limit
    from .tensor import RemoteTensor, typed_key
    from .tensor import _remote as remote

    def make(name: str, runs: str | None = None):
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet), overload)
        recorded = str(op) if runs is None else runs

        made: dict[Any, OutputSpec] = {}  # arguments -> the output (meta kernels of arange & co. are Python)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            fake = _fake_mode()
            if fake is not None:  # torch.compile tracing (torch.tensor(data, device=...) gets here)
                out = op(*args, **dict(kwargs, device=torch.device("meta")))
                return fake.fake_tensor_converter.from_meta_and_device(fake, out, device or torch.device(DEVICE_TYPE))
            stream = stream_for(device.index if device is not None else None)
            default = torch.get_default_dtype()
            if default is not stream.default_dtype:
                stream.follow_default_dtype(default)
            try:
                key: Any = (default, typed_key(args), *((k, typed_key(v)) for k, v in kwargs.items()))
                spec = made.get(key)
            except TypeError:  # (a list among the arguments)
                key, spec = None, None
            if spec is None:
                out = op(*args, **dict(kwargs, device=torch.device("meta")))
                if not scalars.fit(op, args, kwargs, out):  # (raised here as the CPU raises it, or not)
                    if op is torch.ops.aten.full.default:
                        scalars.check_fill(args[1], out.dtype)
                    elif out.numel() * out.element_size() <= refusals.SMALL_BYTES:  # (else: at the next read)
                        op(*args, **dict(kwargs, device=torch.device("cpu")))
                spec = OutputSpec(out, op)
                if key is not None:
                    if len(made) > 10_000:
                        made.clear()
                    made[key] = spec
            assert spec.made is not None  # (a factory makes one fresh tensor)
            shape, _, _, dtype, _ = spec.made
            refuse_over_limit(stream, math.prod(shape) * dtype.itemsize, f"a {DEVICE_TYPE} tensor")
            r = remote(stream, spec.made)
            enc_kwargs = {k: encode_value(v) for k, v in kwargs.items()}
            enc_kwargs["device"] = RemoteDevice()
            stream.record(("op", recorded, tuple(encode_value(a) for a in args), enc_kwargs, (r._rid,), spec.expect))
            return r

        return kernel

    def copy_from(src: Any, dst: Any, non_blocking: bool = False) -> Any:
        """CPU -> remote, remote -> remote and remote -> CPU copies reached below Python dispatch
        (`torch.tensor(data, device=...)` and `.to()` make an empty remote tensor, then copy)."""
        from . import storages
        from .tensor import dispatch

        if _fake_mode() is not None and not isinstance(dst, RemoteTensor):
            return dst  # a fake tensor made above: it has no values to copy into
        src, dst = storages.as_remote(src), storages.as_remote(dst)
        return dispatch(torch.ops.aten.copy_.default, (dst, src), {"non_blocking": non_blocking})

    def copy_from_and_resize(src: Any, dst: Any) -> Any:
        from . import storages
        from .tensor import dispatch

        src, dst = storages.as_remote(src), storages.as_remote(dst)
        if tuple(dst.shape) != tuple(src.shape):
            dispatch(torch.ops.aten.resize_.default, (dst, list(src.shape)), {})
        return dispatch(torch.ops.aten.copy_.default, (dst, src), {})

    # Ops with both device kernels and a generic decomposition (CompositeImplicitAutograd): a device
    # without a kernel of its own gets the decomposition, which rounds differently from the server's
    # kernel. A PrivateUse1 kernel (reached only below Python dispatch) makes them arrive whole.
    def whole(op: Any) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            from .tensor import dispatch

            return dispatch(op, args, kwargs)

        return kernel

    lib.impl(
        "silu_backward", whole(torch.ops.aten.silu_backward.default), "PrivateUse1"
    )  # (mish_backward has no meta kernel)
    # A value read below Python dispatch: `torch.tensor([t[0], t[1]])` reads each element in C++.
    lib.impl("_local_scalar_dense", whole(torch.ops.aten._local_scalar_dense.default), "PrivateUse1")

    # Autograd's zeros that carry no memory (ZeroTensor): plain zeros on the server.
    lib.impl("_efficientzerotensor", make("_efficientzerotensor.default", "aten.zeros.default"), "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", copy_from_and_resize, "PrivateUse1")

    for name in (
        "empty.memory_format",
        "empty_strided.default",
        "arange.start_step",
        "arange.start",
        "arange.default",
        "eye.default",
        "eye.m",
        "linspace.default",
        "logspace.default",
        "randperm.default",
        "range.step",
        "tril_indices.default",
        "triu_indices.default",
        "full.default",
        "zeros.default",
        "ones.default",
        "scalar_tensor.default",
    ):
        packet, overload = name.split(".")
        if hasattr(torch.ops.aten, packet) and overload in getattr(torch.ops.aten, packet).overloads():
            lib.impl(name if overload != "default" else packet, make(name), "PrivateUse1")


def register() -> None:
    """Make `remote_accelerator` a torch device. Idempotent; needs torch imported."""
    global _registered, _lib
    with _lock:
        if _registered:
            return
        import torch
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if torch._C._get_privateuse1_backend_name() not in ("privateuseone", DEVICE_TYPE):
            raise RuntimeError(
                f"PyTorch's PrivateUse1 backend is already taken by {torch._C._get_privateuse1_backend_name()!r}"
            )
        _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_DeviceModule())
        _lib = torch.library.Library("aten", "IMPL")
        _factory_kernels(_lib)
        from . import serialization
        from .tensor import lazy_bits

        serialization.register(lazy_bits)
        from . import accelerator, attention, autocast, compiler, lazy, pinned, safetensors_files, storages, whole_ops

        accelerator.register()
        storages.register()
        lazy.register()
        autocast.register()
        attention.register()
        whole_ops.register()
        pinned.register()
        compiler.register()
        safetensors_files.register()
        _registered = True


_lib: Any = None


def enable(current_client: Callable[[], Any]) -> None:
    """Make the device available (now if torch is imported, else right after it is), served by
    whichever client `current_client()` returns (genie_core's connection, or None)."""
    set_client(current_client)
    after_import("torch", register)
