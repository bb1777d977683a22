"""What an op makes on a CUDA server, said without a GPU (genie_core/remote_tensor/device_model.py):
fake CUDA tensors answer where the meta kernels answer as the CPU does."""

from __future__ import annotations

import pytest
import torch

from genie_core.remote_tensor import device_model

aten = torch.ops.aten


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.mark.parametrize(
    ("op", "args", "on_cuda", "on_cpu"),
    [
        # CUDA's logsigmoid keeps no buffer; the CPU's (and the meta kernel's) is the input's shape
        (aten.log_sigmoid_forward.default, (meta(4, 10),), [(4, 10), (0,)], [(4, 10), (4, 10)]),
        (aten.mm.default, (meta(4, 10), meta(10, 3)), [(4, 3)], [(4, 3)]),
    ],
    ids=["log_sigmoid_forward", "mm"],
)
def test_outputs_are_the_server_device_types(op, args, on_cuda, on_cpu):
    def shapes(out):
        return [tuple(t.shape) for t in (out if isinstance(out, tuple) else (out,))]

    assert shapes(device_model.outputs(op, args, {}, "cuda")) == on_cuda
    assert shapes(device_model.outputs(op, args, {}, "cpu")) == on_cpu


def test_a_data_dependent_shape_is_not_known_here():
    with pytest.raises(device_model.NOT_KNOWN_HERE):
        device_model.outputs(aten.nonzero.default, (meta(5),), {}, "cuda")


def test_below_python_dispatch_too():
    """A kernel the device registers below Python dispatch (`_copy_from`: `torch.tensor(data,
    device=...)`) runs with the Python keys excluded; fake tensors need them (without them: a crash)."""
    python = torch._C.DispatchKeySet(torch._C.DispatchKey.Python).add(torch._C.DispatchKey.PythonTLSSnapshot)
    with torch._C._ExcludeDispatchKeyGuard(python):
        out = device_model.outputs(aten.add.Tensor, (meta(3), meta(3)), {}, "cuda")
    assert out.shape == (3,) and out.device.type == "cuda"
