"""A notebook's numerics settings (remote_tensor/numerics.py), taken before its batch runs: this
process's deterministic algorithms, float32 matmul precision, cuDNN flags and default dtype become
the notebook's."""

from __future__ import annotations

from typing import Any

import torch

_taken: Any = None  # the settings last taken (most batches carry the same)


def take(numerics: Any) -> None:
    global _taken
    if numerics is None:
        return
    _take_default_dtype(numerics[5])  # (each batch: a `%%remote` cell may have set this process's)
    if numerics == _taken:
        return
    deterministic, warn_only, precision, cudnn_deterministic, cudnn_benchmark, _ = numerics
    deterministic_now = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if (bool(deterministic), bool(warn_only)) != deterministic_now:  # (the setter imports ~70 MiB of modules)
        torch.use_deterministic_algorithms(bool(deterministic), warn_only=bool(warn_only))
    if torch.get_float32_matmul_precision() != precision:
        torch.set_float32_matmul_precision(str(precision))
    torch.backends.cudnn.deterministic = bool(cudnn_deterministic)
    torch.backends.cudnn.benchmark = bool(cudnn_benchmark)
    _taken = tuple(numerics)


def _take_default_dtype(name: Any) -> None:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"no such default dtype: {name!r}")
    if torch.get_default_dtype() is not dtype:
        torch.set_default_dtype(dtype)
