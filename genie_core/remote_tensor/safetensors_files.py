"""safetensors files read onto the device, as with `device="cuda"`: `load_file(path,
device="remote_accelerator:0")`, `load_model(model, path, device=...)` and `safe_open(path, "pt",
device=...)`, which transformers and accelerate call.

safetensors takes only the device types it knows (a closed list in its Rust code) and refuses this
one. For it, the file is opened on the CPU (mapped: nothing read yet) and each tensor asked for goes
to the device as it is read, one upload each. (A file on the server's disk loads there, with no byte
through the client: `torch.remote_accelerator.load`.)
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .after_import import after_import
from .connection import DEVICE_TYPE


class _OpenedForTheDevice:
    """What `safe_open` returns, for this device: the CPU handle's answers, its tensors on the device."""

    def __init__(self, opened: Any, device: torch.device) -> None:
        self._opened, self._device = opened, device

    def __enter__(self) -> _OpenedForTheDevice:
        self._opened.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._opened.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._opened.get_tensor(name).to(self._device)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.get_tensor(name) for name in self._opened.keys()}  # noqa: SIM118 (not iterable)

    def get_slice(self, name: str) -> _SliceForTheDevice:
        return _SliceForTheDevice(self._opened.get_slice(name), self._device)

    def __getattr__(self, name: str) -> Any:  # keys, metadata, offset_keys
        return getattr(self._opened, name)


class _SliceForTheDevice:
    """`get_slice(name)`: its shape and dtype as safetensors says them, a slice of it on the device."""

    def __init__(self, sliced: Any, device: torch.device) -> None:
        self._sliced, self._device = sliced, device

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._sliced[index].to(self._device)

    def __getattr__(self, name: str) -> Any:  # get_shape, get_dtype
        return getattr(self._sliced, name)


def _for_this_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == DEVICE_TYPE
    return isinstance(device, str) and device.split(":")[0] == DEVICE_TYPE


def _wrap() -> None:
    """safetensors' `safe_open`, taught this device, where safetensors and its torch module name it."""
    import safetensors

    rusts: Any = safetensors.safe_open
    if getattr(rusts, "_for_remote_accelerator", False):
        return

    def safe_open(filename: Any, framework: str, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device", args[0] if args else "cpu")
        if framework not in ("pt", "torch") or not _for_this_device(device):
            return rusts(filename, framework, *args, **kwargs)
        kwargs.pop("device", None)
        return _OpenedForTheDevice(rusts(filename, framework, "cpu", *args[1:], **kwargs), torch.device(device))

    safe_open._for_remote_accelerator = True  # type: ignore[attr-defined]
    safe_open.__doc__ = rusts.__doc__
    # where it is bound already (`from safetensors import safe_open`: safetensors.torch, and
    # transformers or accelerate if imported first)
    for module in list(sys.modules.values()):
        if getattr(module, "safe_open", None) is rusts:
            module.safe_open = safe_open  # type: ignore[attr-defined]


def register() -> None:
    after_import("safetensors", _wrap)
