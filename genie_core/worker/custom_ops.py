"""Custom ops a client defined in its notebook (`__main__`), which this server cannot import:
defined here from their schema and kernels, sent by value (remote_tensor/custom_ops.py)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from ..protocol.op_records import DefineRecord


def define(record: DefineRecord) -> None:
    """The op defined with the client's kernels (its default one, and one per device type it has);
    nothing if this process has it already (a `%%remote` cell defined it too)."""
    _, name, schema, sent = record
    try:
        torch._C._get_schema(name, "")
        return
    except RuntimeError:
        pass
    kernels = pickle.loads(sent)  # (cloudpickle's output: functions by value)
    parsed = torch._C.parse_schema(name + schema)
    mutates = tuple(a.name for a in parsed.arguments if a.alias_info is not None and a.alias_info.is_write)
    default = kernels.pop(None, None)
    op = torch.library.custom_op(name, default or _no_default(name), mutates_args=mutates, schema=schema)
    for device_type, kernel in kernels.items():
        op.register_kernel(device_type)(kernel)


def _no_default(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"custom op {name} has no kernel for this server's device type")

    return kernel
