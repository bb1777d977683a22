"""Remote tensors: `torch.randn(..., device="remote_accelerator:0")` after `genie_core.init`."""

from .connection import DEVICE_TYPE as DEVICE_TYPE
from .device import enable, register

__all__ = ["DEVICE_TYPE", "enable", "register"]
