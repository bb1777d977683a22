"""`torch.autocast("remote_accelerator")` follows the server device type's own autocast policy, as
the running torch defines it, for every op of PyTorch's OpInfo database: the output dtypes equal
those of CUDA's (and the CPU's) autocast, both computed on fake tensors, so that no GPU is needed to
compare with CUDA. (On a GPU, tests/test_gpu.py compares values with the server's own autocast.)"""

from __future__ import annotations

import concurrent.futures
import logging
import warnings

import pytest
import torch

pytest.importorskip("expecttest")  # torch.testing._internal needs it

from torch._subclasses.fake_tensor import FakeTensorMode

DEV = "remote_accelerator"


def _fake(mode: FakeTensorMode, value, device: str):
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise _NotComparable("a non-strided tensor")
        return mode.fake_tensor_converter.from_meta_and_device(mode, value.detach().to("meta"), torch.device(device))
    if isinstance(value, (list, tuple)):
        return type(value)(_fake(mode, v, device) for v in value)
    if isinstance(value, dict):
        return {k: _fake(mode, v, device) for k, v in value.items()}
    if isinstance(value, torch.device) or value == "cpu":
        return torch.device(device)
    return value


class _NotComparable(Exception):
    pass


def _dtypes(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out.dtype]
    if isinstance(out, (list, tuple)):
        return [d for o in out for d in _dtypes(o)]
    return []


def _run(mode: FakeTensorMode, op, sample, device: str, dtype: torch.dtype) -> list:
    inp, args, kwargs = (_fake(mode, v, device) for v in (sample.input, sample.args, sample.kwargs))
    was_on, was_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, True)  # (torch.autocast("cuda") refuses on a machine without CUDA)
    torch.set_autocast_dtype(device, dtype)
    try:
        with mode:
            return _dtypes(op(inp, *args, **kwargs))
    finally:
        torch.set_autocast_enabled(device, was_on)
        torch.set_autocast_dtype(device, was_dtype)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("server", ["cuda", "cpu"])
def test_every_ops_output_dtype_is_the_server_device_types_under_autocast(monkeypatch, server):
    from genie_core.remote_tensor import autocast, device

    device.register()
    monkeypatch.setattr(autocast, "_server_device_type", lambda: server)  # the policy a server of that type gets
    monkeypatch.setattr(logging.getLogger("torch._subclasses.fake_tensor"), "disabled", True)  # (samples refused)
    # in a thread of its own: OpInfo's samples look at the caller's stack, which under pytest is deep and slow
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        compared, differ = pool.submit(_compare_all, server).result()
    assert compared > 900, f"only {compared} samples compared: the harness lost ops"
    assert not differ, f"{len(differ)} of {compared} differ from {server}'s autocast: {differ[:10]}"


def _compare_all(server: str) -> tuple[int, list]:
    from torch.testing._internal.common_methods_invocations import op_db

    from genie_core.errors import NotInitializedError

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    compared, differ = 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in op_db:
            if torch.float32 not in op.supported_dtypes("cpu"):
                continue
            try:
                sample = next(iter(op.sample_inputs("cpu", torch.float32)))
            except Exception:
                continue
            for dtype in (torch.float16, torch.bfloat16):
                try:
                    expected = _run(mode, op, sample, server, dtype)
                except Exception:
                    continue  # the device's own kernels refuse this sample (or fake tensors cannot run it)
                try:
                    got = _run(mode, op, sample, DEV, dtype)
                except NotInitializedError:
                    continue  # needs a session (an op run on the server to learn its output)
                except Exception as exc:
                    got = [f"{type(exc).__name__}: {str(exc)[:80]}"]
                compared += 1
                if got != expected:
                    differ.append((op.name, op.variant_test_name, str(dtype), expected, got))
    return compared, differ
