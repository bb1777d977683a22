"""Custom ops a client defined in its notebook (`__main__`), which this server cannot import:
defined here from their schema, kernels and fake, sent by value (remote_tensor/custom_ops.py)."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..protocol.op_records import DefineRecord


def define(record: DefineRecord) -> None:
    """The op defined with the client's kernels (its default one, and one per device type it has)
    and fake; kernels sent again (changed on the client) replace the ones before. An op of that name
    this process has and did not define as a custom op (a C++ one) is left as it is."""
    _, name, schema, sent = record
    try:
        sent_here = pickle.loads(sent)  # (cloudpickle's output: functions by value)
    except Exception as e:
        raise RuntimeError(
            f"custom op {name} cannot be defined on the server ({type(e).__name__}: {e}); its kernels travel "
            f"by value, which needs the client's Python version here (this server runs Python "
            f"{sys.version_info[0]}.{sys.version_info[1]})"
        ) from e
    kernels, fake = dict(sent_here["kernels"]), sent_here["fake"]
    from torch._library.custom_ops import OPDEFS

    op = OPDEFS.get(name)
    if op is None:
        try:
            torch._C._get_schema(name, "")
            return  # (not a custom op of Python's)
        except RuntimeError:
            pass
        parsed = torch._C.parse_schema(name + schema)
        mutates = tuple(a.name for a in parsed.arguments if a.alias_info is not None and a.alias_info.is_write)
        op = torch.library.custom_op(
            name, kernels.pop(None, None) or _no_default(name), mutates_args=mutates, schema=schema
        )
    for device_type, kernel in kernels.items():
        op.register_kernel(device_type)(kernel)
    if fake is not None:
        op.register_fake(fake)


def _no_default(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"custom op {name} has no kernel for this server's device type")

    return kernel
