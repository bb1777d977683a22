"""Remote tensors: `torch.randn(..., device="remote_accelerator:0")` after `genie_core.init`."""

from .device import DEVICE_TYPE, enable, register

__all__ = ["DEVICE_TYPE", "enable", "register"]
