"""The notebook's numerics settings, in force where its ops run: `torch.use_deterministic_algorithms`
(index_copy_, scatter and index_put with repeated indices then give the same result every run),
`torch.set_float32_matmul_precision` (TF32 on a GPU: "high" and "medium"), and cuDNN's
`deterministic` and `benchmark`. A CUDA device runs under the process's settings; a remote one's
server runs under its own, so each batch carries the notebook's, read as it is sent (a setting
changed between two ops with no value read between them applies to their whole batch), and the
worker takes them before it runs the batch (worker/numerics.py)."""

from __future__ import annotations

from ..protocol.contents import Numerics


def current() -> Numerics:
    """This process's settings (a few calls into PyTorch: once per batch)."""
    import torch

    cudnn = torch.backends.cudnn
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_float32_matmul_precision(),
        bool(cudnn.deterministic),
        bool(cudnn.benchmark),
    )
