"""What an op makes on a CUDA server, worked out here without running it there.

PyTorch's meta kernels describe an op's outputs for a device-less tensor, and some answer as the
CPU does where CUDA makes another shape or dtype (log_sigmoid's buffer, among others). PyTorch
models each device type with fake tensors, as torch.compile does when it traces for CUDA: a fake
CUDA tensor runs the meta kernel with the device it stands for, and the kernel answers for CUDA. So
on a CUDA server an op's outputs come from the op run on fake CUDA tensors; where the client's torch
cannot model CUDA (an op that asks the CUDA runtime, on a machine without it), from the meta kernel.
A CPU server keeps the meta kernels, whose answers its worker was built and tested against (its
shims run what CUDA runs and a CPU refuses, which a fake CPU tensor would refuse here). Either way
the server checks every output against what was said here.
"""

from __future__ import annotations

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
# Fake tensors need the Python keys, which a kernel reached below Python dispatch (the device's
# `_copy_from`) runs with excluded
_PYTHON_KEYS = [torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot]


def outputs(func: Any, margs: tuple, mkwargs: dict, device_type: str) -> Any:
    """`func`'s outputs for these arguments (meta tensors, and `torch.device("meta")` for the remote
    device) on a server of `device_type`: fake CUDA tensors, or meta tensors."""
    if device_type != "cuda" or _has_storage(margs, mkwargs):
        return func(*margs, **mkwargs)  # (storages cannot be made fake from meta ones)
    mode = getattr(_modes, "mode", None)
    if mode is None:
        mode = _modes.mode = FakeTensorMode(allow_fallback_kernels=False)  # never runs a real kernel
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _PYTHON_KEYS:
        exclude = exclude.remove(key)
    device = torch.device("cuda", 0)

    def fake(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return mode.fake_tensor_converter.from_meta_and_device(mode, a, device)
        if isinstance(a, torch.device) and a.type == "meta":
            return device
        if type(a) in (list, tuple):
            return type(a)(fake(x) for x in a)
        return a

    fargs, fkwargs = fake(margs), {k: fake(v) for k, v in mkwargs.items()}
    try:
        with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), mode:
            return func(*fargs, **fkwargs)
    except NOT_KNOWN_HERE:
        raise
    except (AssertionError, RuntimeError) as exc:
        if not _needs_cuda(exc):
            raise
    return func(*margs, **mkwargs)  # this torch cannot model a CUDA device here: the meta kernel says


def _has_storage(margs: tuple, mkwargs: dict) -> bool:
    return any(isinstance(a, torch.UntypedStorage) for a in (*margs, *mkwargs.values()))


def _needs_cuda(exc: BaseException) -> bool:
    """Whether a fake CUDA tensor's op failed for want of the CUDA runtime on this machine."""
    text = str(exc)
    return "compiled with CUDA" in text or "support for cuda" in text or "NVIDIA driver" in text
