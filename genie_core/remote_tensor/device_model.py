"""What an op makes on the server's device type, worked out here without running it there.

PyTorch's meta kernels describe an op's outputs for a device-less tensor, and some answer as the
CPU does where CUDA makes another shape or dtype (log_sigmoid's buffer, among others). PyTorch
models each device type with fake tensors, as torch.compile does when it traces for CUDA: a fake
CUDA tensor runs the meta kernel with the device it stands for, and the kernel answers for CUDA. So
on a CUDA server an op's outputs come from the op run on fake CUDA tensors; where the client's torch
cannot model CUDA (an op that asks the CUDA runtime, on a machine without it), from the meta kernel.
A CPU server's likewise come from fake CPU tensors: a meta kernel alone lays some outputs out
otherwise than the CPU does (a convolution of a channels-last input: contiguous, where the CPU's is
channels-last), and the worker then copied each such output to the layout said here, after which
the model's reductions summed in another order than the CPU's. Where the CPU's model refuses an
op that the worker's shims run as CUDA would (cpu_shims.py: `histc` of integers), the meta kernel
says. Either way the server checks every output against what was said here.
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


class _Quiet(logging.Filter):
    """FakeTensorMode logs a traceback at ERROR for every op its kernel refuses before it raises:
    a shape error in the user's code, or an op the CPU's model refuses (then the meta kernel says),
    would print one above the error itself. Not while this thread asks the model here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_modes, "asking", False)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_Quiet())
# Fake tensors need the Python keys, which a kernel reached below Python dispatch (the device's
# `_copy_from`) runs with excluded
_PYTHON_KEYS = [torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot]


def outputs(func: Any, margs: tuple, mkwargs: dict, device_type: str) -> Any:
    """`func`'s outputs for these arguments (meta tensors, and `torch.device("meta")` for the remote
    device) on a server of `device_type`: fake CUDA or CPU tensors, or meta tensors."""
    if _has_storage(margs, mkwargs):
        return func(*margs, **mkwargs)  # (storages cannot be made fake from meta ones)
    mode = getattr(_modes, "mode", None)
    if mode is None:
        mode = _modes.mode = FakeTensorMode(allow_fallback_kernels=False)  # never runs a real kernel
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _PYTHON_KEYS:
        exclude = exclude.remove(key)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")

    def fake(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return mode.fake_tensor_converter.from_meta_and_device(mode, a, device)
        if isinstance(a, torch.device) and a.type == "meta":
            return device
        if type(a) in (list, tuple):
            return type(a)(fake(x) for x in a)
        return a

    fargs, fkwargs = fake(margs), {k: fake(v) for k, v in mkwargs.items()}
    _modes.asking = True
    try:
        with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), mode:
            return func(*fargs, **fkwargs)
    except NOT_KNOWN_HERE:
        raise
    except (AssertionError, RuntimeError, NotImplementedError) as exc:
        if device_type == "cuda" and not _needs_cuda(exc):
            raise
    finally:
        _modes.asking = False
    # this torch cannot model a CUDA device here, or the CPU's model refuses what the worker's shims
    # run (cpu_shims.py): the meta kernel says
    return func(*margs, **mkwargs)


def _has_storage(margs: tuple, mkwargs: dict) -> bool:
    return any(isinstance(a, torch.UntypedStorage) for a in (*margs, *mkwargs.values()))


def _needs_cuda(exc: BaseException) -> bool:
    """Whether a fake CUDA tensor's op failed for want of the CUDA runtime on this machine."""
    text = str(exc)
    return "compiled with CUDA" in text or "support for cuda" in text or "NVIDIA driver" in text
