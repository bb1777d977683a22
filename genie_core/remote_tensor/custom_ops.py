"""Custom ops (`torch.library.custom_op`) on the remote device. One defined in a module is imported
on the server before its first use; one defined in the notebook itself (`__main__`), which the
server cannot import, is sent there by value: its schema, kernels and fake (`register_fake`: the
server's torch.compile traces with it), defined again on the server (worker/custom_ops.py) before
its first use, and again whenever its kernels change, as a CUDA device would run the same kernels."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from .stream import OpStream


def make_known(func: Any, stream: OpStream) -> None:
    """Before `func` (an op outside aten and prims) is recorded on `stream`: its module imported on
    the server, or its definition sent there (once, and again when its kernels changed)."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func._qualified_op_name if isinstance(func, torch._ops.OpOverloadPacket) else func._schema.name)
    module = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
    if module == "__main__":
        _define(opdef, stream)
    elif module and module not in stream.definitions.imported:
        stream.definitions.imported.add(module)
        stream.record(("import", module))
        stream.definitions.sent(module)
        stream.new_generation()  # (a module may register kernels for any op)


def _define(opdef: Any, stream: OpStream) -> None:
    name = f"{opdef._namespace}::{opdef._name}"
    kernels = (*opdef._backend_fns.items(), ("fake", opdef._abstract_fn))
    if stream.definitions.defined.get(name) == kernels:
        return
    import cloudpickle

    schema = str(opdef._opoverload._schema)
    written = {device: _as_written(fn) for device, fn in opdef._backend_fns.items()}
    try:
        sent = cloudpickle.dumps({"kernels": written, "fake": opdef._abstract_fn, "python": sys.version_info[:2]})
    except Exception as e:
        raise RuntimeError(
            f"custom op {name}: its kernels cannot be sent to the server ({type(e).__name__}: {e}); define it "
            "in a module the server can import"
        ) from e
    stream.definitions.defined[name] = kernels
    stream.record(("define", name, schema[schema.index("(") :], sent))
    stream.definitions.sent(name)


def _as_written(kernel: Any) -> Any:
    """A kernel as the user wrote it. PyTorch keeps each in a closure over it, its variable `fn`
    (torch 2.11 to 2.15; the torch-range lanes run tests/test_custom_ops.py), beside the op's
    definition, which cannot be sent."""
    kernel = inspect.unwrap(kernel)
    code = getattr(kernel, "__code__", None)
    if code is not None and "fn" in code.co_freevars and kernel.__closure__:
        return kernel.__closure__[code.co_freevars.index("fn")].cell_contents
    return kernel
