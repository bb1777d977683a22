"""The notebook's numerics settings, in force where its ops run: `torch.use_deterministic_algorithms`
(index_copy_, scatter and index_put with repeated indices then give the same result every run),
`torch.set_float32_matmul_precision` (TF32 on a GPU: "high" and "medium"), cuDNN's
`deterministic` and `benchmark`, and the default dtype (`torch.set_default_dtype`: the dtype of a
factory's output and of a Python float's). A CUDA device runs under the process's settings; a
remote one's server runs under its own, so each batch carries the notebook's, and the worker takes
them before it runs the batch (worker/numerics.py). The first four are read as the batch is sent
(a setting changed between two ops with no value read between them applies to their whole batch);
the default dtype is the one the batch's ops were recorded under (a change sends what was recorded
before it: OpStream.follow_default_dtype), as their outputs' dtypes here were."""

from __future__ import annotations

from typing import Any

from ..protocol.contents import Numerics


def current(default_dtype: Any) -> Numerics:
    """This process's settings, with the default dtype a batch was recorded under (a few calls
    into PyTorch: once per batch)."""
    import torch

    cudnn = torch.backends.cudnn
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
        bool(cudnn.deterministic),
        bool(cudnn.benchmark),
        str(default_dtype).removeprefix("torch."),
    )
