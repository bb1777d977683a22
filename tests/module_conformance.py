"""PyTorch's ModuleInfo database (`torch.testing._internal.common_modules.module_db`) on
`remote_accelerator`, against eager CPU.

It runs in the child processes of opinfo_conformance.py (`run(..., kind="modules")`), one module
at a time. For each module, in training and in eval mode, its first `SAMPLES` float32 inputs
(`module_inputs_func`, with requires_grad=True; float64 for the few whose float32 samples the CPU
itself refuses): the module is built on the CPU with a fixed seed
and a deep copy moved to the device (`.to(DEV)`); the forward runs on both under the same seed
and the outputs are compared; then the gradients of the outputs (with the same random cotangents)
with respect to the inputs and every parameter are compared with CPU autograd.
"""

from __future__ import annotations

import copy
from typing import Any

from opinfo_conformance import DEV, GPU, _compare, _differentiable, _RandomOps, _reason, _Skip, _to_remote

SAMPLES = 3


def _remote(value: Any, memo: dict[int, Any]) -> Any:
    """A sample argument on the device, requires_grad kept (a PackedSequence stays one). A tensor
    passed twice (KLDivLoss's input and target) is one remote tensor, as its gradient is one."""
    import torch

    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_remote(v, memo) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_remote(v, memo) for v in value)
    if isinstance(value, dict):
        return {k: _remote(v, memo) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = _to_remote(value, requires_grad=True)
        return memo[id(value)]
    return _to_remote(value, requires_grad=True)


def _local(value: Any) -> Any:
    """A result on the CPU, each remote tensor checked against what the client believes."""
    from opinfo_conformance import _fetch

    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_local(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return _fetch(value)


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flat(v)]
    return [value]


def _inputs_needing_grad(args: Any) -> list[Any]:
    import torch

    return [t for t in _flat(args) if isinstance(t, torch.Tensor) and t.requires_grad]


def _sample(info: Any, sample: Any, training: bool) -> tuple[bool, bool | None]:
    """(forward bit-exact, backward bit-exact or None when nothing is differentiable)."""
    import torch

    torch.manual_seed(0)
    try:
        module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs)
    except Exception as exc:
        raise _Skip(f"the CPU cannot build it: {type(exc).__name__}") from exc
    module.train(training)
    remote = copy.deepcopy(module).to(DEV)
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    torch.manual_seed(1234)
    try:
        expected = module(*args, **kwargs)
    except Exception as exc:
        raise _Skip(f"the CPU raises: {type(exc).__name__}") from exc
    memo: dict[int, Any] = {}
    r_args, r_kwargs = _remote(args, memo), _remote(kwargs, memo)
    torch.manual_seed(1234)
    actual = remote(*r_args, **r_kwargs)
    exact = _compare(_local(actual), expected, "output")

    outs, r_outs = _differentiable(_flat(expected)), _differentiable(_flat(actual))
    inputs = _inputs_needing_grad([args, kwargs]) + [p for p in module.parameters() if p.requires_grad]
    r_inputs = _inputs_needing_grad([r_args, r_kwargs]) + [p for p in remote.parameters() if p.requires_grad]
    if not outs or not inputs:
        return exact, None
    if len(r_outs) != len(outs) or len(r_inputs) != len(inputs):
        raise AssertionError(
            f"{len(r_outs)} differentiable outputs for {len(r_inputs)} inputs instead of {len(outs)} for {len(inputs)}"
        )
    torch.manual_seed(99)
    cotangents = [torch.randn_like(t) for t in outs]
    try:
        want = torch.autograd.grad(outs, inputs, cotangents, allow_unused=True)
    except Exception as exc:
        raise _Skip(f"the CPU's backward raises: {type(exc).__name__}") from exc
    try:
        got = torch.autograd.grad(r_outs, r_inputs, [c.to(DEV) for c in cotangents], allow_unused=True)
        return exact, _compare(_local(list(got)), list(want), "gradient")
    except AssertionError as exc:
        raise _BackwardWrong(_reason(exc)) from exc
    except Exception as exc:
        raise _BackwardError(_reason(exc)) from exc


class _BackwardWrong(Exception):
    """The forward matched; the gradients do not."""


class _BackwardError(Exception):
    """The forward matched; the backward raised."""


def _draws_random_numbers(info: Any, sample: Any, training: bool) -> bool:
    """Whether the module's forward draws random numbers (dropout): noted in the report, and
    counted all the same (on a CPU server, seeded alike, it must give the CPU's values)."""
    import torch

    try:
        torch.manual_seed(0)
        module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).train(training)
        with _RandomOps() as seen:
            module(*sample.forward_input.args, **sample.forward_input.kwargs)
        return seen.random
    except Exception:
        return False


def run_module(info: Any) -> dict[str, Any]:
    """One module's result, in the shape opinfo_conformance's report reads (forward, backward)."""
    import torch

    result: dict[str, Any] = {"op": info.formatted_name, "random": False, "nondeterministic": False}
    forward: dict[str, Any] = {"status": "skip", "samples": 0, "exact": True, "dtypes": []}
    backward: dict[str, Any] = {"status": "skip", "samples": 0, "exact": True}
    for dtype in (torch.float32, torch.float64):  # float64 only where the CPU runs no float32 sample
        if dtype in info.supported_dtypes("cpu") and forward["status"] == "skip":
            forward["dtypes"] = [str(dtype).removeprefix("torch.")]
            _run_dtype(info, dtype, result, forward, backward)
    result["forward"], result["backward"] = forward, backward
    return result


def _run_dtype(
    info: Any, dtype: Any, result: dict[str, Any], forward: dict[str, Any], backward: dict[str, Any]
) -> None:
    for training in (True, False):
        mode = "train" if training else "eval"
        try:
            samples = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=training)
        except Exception as exc:
            forward.setdefault("notes", []).append(f"{mode}: no samples ({type(exc).__name__})")
            continue
        for sample in samples[:SAMPLES]:
            if GPU and _draws_random_numbers(info, sample, training):  # CUDA's generator is not the CPU's:
                result["draws_random"] = True  # this mode is not compared (eval mode, without dropout, is)
                break
            try:
                exact, grad_exact = _sample(info, sample, training)
            except _Skip:
                continue
            except (_BackwardWrong, _BackwardError) as exc:
                status = "wrong" if isinstance(exc, _BackwardWrong) else "error"
                backward.update(status=status, reason=f"{mode}: {exc}")
                forward["samples"] += 1
                forward["status"] = "match" if forward["status"] == "skip" else forward["status"]
                break
            except AssertionError as exc:
                forward.update(status="wrong", reason=f"{mode}: {_reason(exc)}")
                break
            except Exception as exc:
                forward.update(status="error", reason=f"{mode}: {_reason(exc)}")
                break
            if forward["samples"] == 0:
                result["draws_random"] = _draws_random_numbers(info, sample, training)
            forward["samples"] += 1
            forward["exact"] &= exact
            if forward["status"] == "skip":
                forward["status"] = "match"
            if grad_exact is not None:
                backward["samples"] += 1
                backward["exact"] &= grad_exact
                if backward["status"] == "skip":
                    backward["status"] = "match"
        if forward["status"] in ("wrong", "error") or backward["status"] in ("wrong", "error"):
            break
