"""What an op makes on the server's device type, worked out here without running it there.

PyTorch's meta kernels describe an op's outputs for a device-less tensor, and some answer as the
CPU does where CUDA makes another shape or dtype (log_sigmoid's buffer, among others). PyTorch
models each device type with fake tensors, as torch.compile does when it traces for CUDA: a fake
CUDA tensor runs the meta kernel with the device it stands for, and the kernel answers for CUDA. So
on a CUDA server an op's outputs come from the op run on fake CUDA tensors; where the client's torch
cannot model CUDA (an op that asks the CUDA runtime, on a machine without it), from the meta kernel.
A CPU server's come from the meta kernels, except the ops a meta kernel lays out otherwise than
the CPU (a convolution of a channels-last input): those from fake CPU tensors, so that the worker
need not copy the CPU's output to another layout, whose later reductions would sum in another
order than the CPU's. Either way the server checks every output against what was said here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

# What an op run on fake tensors raises when its output shape depends on the data, or when it has
# no meta kernel: both are run on the server instead (one round trip)
NOT_KNOWN_HERE = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)

# One fake tensor mode a thread: a mode keeps state while it runs an op (autograd runs backward
# on a thread of its own for each device)
_modes = threading.local()

_MODELLED = {"cuda": torch.device("cuda", 0), "cpu": torch.device("cpu")}
# The ops whose meta kernel lays an output out otherwise on a meta device than on the CPU (a
# channels-last input's convolution: contiguous, where the CPU's is channels-last): a CPU server's
# come from fake CPU tensors, the rest from the meta kernels (fake tensors cost 5 to 20 times as
# much for each signature an op meets first)
_LAID_OUT_BY_DEVICE = frozenset(
    {
        torch.ops.aten.convolution.default,
        torch.ops.aten.convolution_backward.default,
        torch.ops.aten._convolution.default,
    }
)


class _Quiet(logging.Filter):
    """FakeTensorMode logs a traceback at ERROR for every op its kernel refuses before it raises: a
    shape error in the user's code would print one above the error itself. Not while this thread
    asks the model here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_modes, "asking", False)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_Quiet())
# Fake tensors need the Python keys, which a kernel reached below Python dispatch (the device's
# `_copy_from`) runs with excluded
_PYTHON_KEYS = [torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot]


def outputs(func: Any, margs: tuple, mkwargs: dict, device_type: str) -> Any:
    """`func`'s outputs for these arguments (meta tensors, and `torch.device("meta")` for the remote
    device) on a server of `device_type`: fake CUDA or CPU tensors, or meta tensors."""
    if (device_type == "cpu" and func not in _LAID_OUT_BY_DEVICE) or _has_storage(margs, mkwargs):
        return func(*margs, **mkwargs)  # (storages cannot be made fake from meta ones)
    if device_type not in _MODELLED:
        raise ValueError(f"no model of a {device_type!r} server's ops (known: {', '.join(_MODELLED)})")
    mode = getattr(_modes, "mode", None)
    if mode is None:
        mode = _modes.mode = FakeTensorMode(allow_fallback_kernels=False)  # never runs a real kernel
        mode.cache_enabled = False  # (the op stream's meta cache keeps what is said here, and is bounded)
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _PYTHON_KEYS:
        exclude = exclude.remove(key)
    device = _MODELLED[device_type]

    def fake(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return mode.fake_tensor_converter.from_meta_and_device(mode, a, device)
        if isinstance(a, torch.device) and a.type == "meta":
            return device
        if type(a) in (list, tuple):
            return type(a)(fake(x) for x in a)
        return a

    fargs, fkwargs = fake(margs), {k: fake(v) for k, v in mkwargs.items()}
    asking, _modes.asking = getattr(_modes, "asking", False), True
    try:
        with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), mode:
            return func(*fargs, **fkwargs)
    except NOT_KNOWN_HERE:
        raise
    except (AssertionError, RuntimeError) as exc:
        if device_type != "cuda" or not _needs_cuda(exc):
            raise
    finally:
        _modes.asking = asking
    return func(*margs, **mkwargs)  # this torch cannot model a CUDA device here: the meta kernel says


def _has_storage(margs: tuple, mkwargs: dict) -> bool:
    return any(isinstance(a, torch.UntypedStorage) for a in (*margs, *mkwargs.values()))


def _needs_cuda(exc: BaseException) -> bool:
    """Whether a fake CUDA tensor's op failed for want of the CUDA runtime on this machine."""
    text = str(exc)
    return "compiled with CUDA" in text or "support for cuda" in text or "NVIDIA driver" in text
