"""Lazy modules (`nn.LazyLinear`, `LazyConv2d`, ...) moved to the device before their first forward,
as people do with CUDA: their parameters stay uninitialized, now on the device, and the first
forward materializes them there."""

from __future__ import annotations

from typing import Any

import torch

from .tensor import RemoteTensor

aten = torch.ops.aten


class _Uninitialized(RemoteTensor):
    """An uninitialized parameter or buffer on `remote_accelerator` (what `.to()` makes of a lazy
    module's). Only what `nn.Module.to()` and `materialize` need works on it."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    shape = torch.Tensor.shape  # (the mixin refuses it; the ops that move it ask)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.detach.default:  # nn.Parameter(this) detaches and wants the same kind back
            this = args[0]
            return RemoteTensor.__new__(cls, this.shape, this.stride(), this.storage_offset(), this.dtype, this._stream)
        raise ValueError(
            f"{func}: this parameter is not initialized yet (a lazy module's): run a forward first to initialize it"
        )

    def materialize(self, shape: Any, device: Any = None, dtype: Any = None) -> None:
        """Become a remote tensor of `shape` (uninitialized values, as torch.empty)."""
        made = torch.empty(
            shape, device=self.device if device is None else device, dtype=self.dtype if dtype is None else dtype
        )
        made.requires_grad_(self.requires_grad)
        torch.utils.swap_tensors(self, made)


class UninitializedRemoteParameter(_Uninitialized, torch.nn.UninitializedParameter):
    pass


class UninitializedRemoteBuffer(_Uninitialized, torch.nn.UninitializedBuffer):
    pass


def uninitialized_on_device(dst: RemoteTensor, src: Any) -> RemoteTensor:
    """`.to(remote_accelerator)` of a lazy module's parameter or buffer: the empty remote tensor
    that `to` made, marked uninitialized."""
    parameter = isinstance(src, torch.nn.UninitializedParameter)
    dst.__class__ = UninitializedRemoteParameter if parameter else UninitializedRemoteBuffer
    return dst


def register() -> None:
    """Make `.to(remote_accelerator)` of an uninitialized parameter or buffer one of these."""
    from . import tensor

    tensor.uninitialized_copy = uninitialized_on_device
