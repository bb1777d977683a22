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


def test_a_server_of_an_unknown_kind_is_refused_in_words():
    """Not a KeyError from deep inside: the kinds modelled are named."""
    with pytest.raises(ValueError, match="no model of a 'xpu' server's ops \\(known: cuda, cpu\\)"):
        device_model.outputs(aten.convolution.default, (meta(1, 1, 3, 3), meta(1, 1, 1, 1)), {}, "xpu")


def test_below_python_dispatch_too():
    """A kernel the device registers below Python dispatch (`_copy_from`: `torch.tensor(data,
    device=...)`) runs with the Python keys excluded; fake tensors need them (without them: a crash)."""
    python = torch._C.DispatchKeySet(torch._C.DispatchKey.Python).add(torch._C.DispatchKey.PythonTLSSnapshot)
    with torch._C._ExcludeDispatchKeyGuard(python):
        out = device_model.outputs(aten.add.Tensor, (meta(3), meta(3)), {}, "cuda")
    assert out.shape == (3,) and out.device.type == "cuda"


def channels_last(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(memory_format=torch.channels_last)


CPU_LAYOUTS = {  # ops whose outputs a meta kernel alone lays out otherwise than the CPU
    "conv2d": (aten.convolution.default, (channels_last(2, 8, 8, 8), torch.randn(4, 8, 3, 3), None), (1, 1), 1),
    "depthwise conv2d": (
        aten.convolution.default,
        (channels_last(2, 8, 8, 8), torch.randn(8, 1, 7, 7), None),
        (3, 3),
        8,
    ),
}


@pytest.mark.parametrize("name", list(CPU_LAYOUTS))
def test_a_cpu_servers_outputs_are_laid_out_as_the_cpus(name):
    """From fake CPU tensors: the meta kernel's contiguous output made the worker copy the CPU's
    channels-last one, and the model's later reductions then summed in another order."""
    op, (x, w, b), padding, groups = CPU_LAYOUTS[name]
    args = (x, w, b, [1, 1], list(padding), [1, 1], False, [0, 0], groups)
    real = op(*args)
    said = device_model.outputs(op, tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args), {}, "cpu")
    assert real.is_contiguous(memory_format=torch.channels_last) and said.stride() == real.stride()
    grad = torch.randn_like(real)
    backward = (grad, x, w, [4], [1, 1], list(padding), [1, 1], False, [0, 0], groups, [True, True, True])
    real_grads = aten.convolution_backward.default(*backward)
    said_grads = device_model.outputs(
        aten.convolution_backward.default,
        tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in backward),
        {},
        "cpu",
    )
    assert [g.stride() for g in said_grads] == [g.stride() for g in real_grads]


def test_a_shape_error_is_one_error_with_no_logged_traceback_above_it():
    """FakeTensorMode logs a traceback for each op its kernel refuses; a user's shape error, asked of
    the model here, is the error alone."""
    import logging

    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_tensor_log.addHandler(handler)
    conv = (meta(2, 3, 8, 8), meta(4, 5, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)  # 3 != 5 channels
    try:
        with pytest.raises(RuntimeError, match="broadcast"):
            device_model.outputs(aten.add.Tensor, (meta(3), meta(4)), {}, "cuda")
        with pytest.raises(RuntimeError, match="channels"):
            device_model.outputs(aten.convolution.default, conv, {}, "cpu")
    finally:
        fake_tensor_log.removeHandler(handler)
    assert not logged
