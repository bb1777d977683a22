"""PyTorch's OpInfo database on `remote_accelerator`, against eager CPU.

The parent (`run`) hands ops, one at a time, to a few child processes (`python
opinfo_conformance.py --child ADDRESS TOKEN`), each connected to the server as its own session.
A child that dies (a crash, here or in its session's worker) or hangs costs only the op it was
running, which is counted as a crash, and is replaced. Every child runs, for one op: its first
samples in each tested dtype on the CPU and on the device, compares them, and, for ops that
support autograd, compares float32 gradients with CPU autograd.

What is sampled (kept small so the whole suite fits CI): the first `SAMPLES[dtype]` samples of
`op.sample_inputs("cpu", dtype)` for float32, float16, bfloat16, int64, bool and complex64 (those
the op supports on the CPU), each through the op and its in-place variant, and the first
`GRAD_SAMPLES` float32 samples with requires_grad=True.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import Any

DEV = "remote_accelerator:0"
SAMPLES = {"float32": 4, "float16": 1, "bfloat16": 1, "int64": 2, "bool": 1, "complex64": 1}
GRAD_SAMPLES = 2
OP_TIMEOUT_S = 90.0
GPU = os.environ.get("GENIE_CONFORMANCE_DEVICE") == "gpu"  # the server computes on a GPU: compare within tolerance
# A GPU's result against the CPU's, per dtype (relative and absolute): float32 and complex64 as
# PyTorch's own CPU-vs-CUDA test (test_compare_cpu: sums reduced in other orders; TF32 off); the half
# types a few of their ulps (float16's is 9.8e-4, bfloat16's 7.8e-3), both devices computing in
# float32 and rounding once, maybe the other way
GPU_TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}


# -- child ------------------------------------------------------------------------------------
def _op_id(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


class _Skip(Exception):
    """The CPU itself fails on this sample (or it cannot be compared): not the device's business."""


def _to_remote(value: Any, requires_grad: bool = False) -> Any:
    """A CPU sample argument on the device. A view keeps its whole storage, so ops that read the
    storage (as_strided) see the same bytes as on the CPU."""
    import torch

    if isinstance(value, torch.Tensor) and value.layout != torch.strided:
        return value.detach().to(DEV).requires_grad_(requires_grad and value.requires_grad)
    if isinstance(value, torch.Tensor):
        t = value.detach()
        storage = t.untyped_storage()
        extent = t.element_size() * t.numel()
        if (
            t.numel()
            and (t.storage_offset() or storage.nbytes() != extent or not t.is_contiguous())
            and t.layout == torch.strided
        ):
            flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
            r = flat.to(DEV).as_strided(t.shape, t.stride(), t.storage_offset())
        else:
            r = t.to(DEV)
        return r.requires_grad_(requires_grad and value.requires_grad)
    if isinstance(value, torch.device) or (isinstance(value, str) and value == "cpu"):
        return torch.device(DEV)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_remote(v, requires_grad) for v in value)
    if isinstance(value, dict):
        return {k: _to_remote(v, requires_grad) for k, v in value.items()}
    return value


def _fetch(value: Any) -> Any:
    """Remote tensors in a result, on the CPU; each checked against what the client believes."""
    import torch

    from genie_core.remote_tensor.tensor import RemoteTensor

    if isinstance(value, RemoteTensor):
        local = value._stream.fetch(value._rid)  # the server's tensor as it is, not converted to what we believe
        if local.shape != value.shape or local.dtype != value.dtype:
            raise AssertionError(
                f"the server's tensor is {tuple(local.shape)} {local.dtype}, the client believes "
                f"{tuple(value.shape)} {value.dtype}"
            )
        return local
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise AssertionError(f"a result on {value.device}")
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_fetch(v) for v in value)
    if isinstance(value, dict):
        return {k: _fetch(v) for k, v in value.items()}
    return value


def _compare(actual: Any, expected: Any, where: str) -> bool:
    """Raise AssertionError on a mismatch; return whether it matched bit for bit."""
    import torch

    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{where}: expected a tensor, got {type(actual).__name__}")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise AssertionError(
                f"{where}: {tuple(actual.shape)} {actual.dtype} instead of {tuple(expected.shape)} {expected.dtype}"
            )
        if expected.dtype == torch.complex32:  # few CPU kernels take it, comparisons included
            actual, expected = actual.to(torch.complex64), expected.to(torch.complex64)
        if expected.is_complex() or expected.is_floating_point():
            tolerance = {}
            if GPU:  # another device's kernels: see GPU_TOLERANCE
                loose = GPU_TOLERANCE.get(str(expected.dtype).removeprefix("torch."), 1e-3)
                tolerance = {"atol": loose, "rtol": loose}
            torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{where}: {m}", **tolerance)
            return bool(
                torch.equal(actual, expected)
                or (
                    (torch.isnan(actual) == torch.isnan(expected)).all()
                    and torch.equal(actual.nan_to_num(), expected.nan_to_num())
                )
            )
        if not torch.equal(actual, expected):
            raise AssertionError(f"{where}: values differ")
        return True
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise AssertionError(f"{where}: expected a sequence of {len(expected)}")
        # every element compared (a mismatch anywhere raises), not only up to the first inexact one
        exact = [_compare(a, e, f"{where}[{i}]") for i, (a, e) in enumerate(zip(actual, expected, strict=True))]
        return all(exact)
    if isinstance(expected, float) and isinstance(actual, float):
        if not (
            actual == expected
            or (actual != actual and expected != expected)
            or abs(actual - expected) <= 1e-5 * max(1, abs(expected))
        ):
            raise AssertionError(f"{where}: {actual} instead of {expected}")
        return actual == expected
    if actual != expected:
        raise AssertionError(f"{where}: {actual!r} instead of {expected!r}")
    return True


def _samples(op: Any, dtype: Any, n: int, requires_grad: bool) -> list[tuple[Any, Any]]:
    """The first n samples, each marked with which of its tensors stay on the CPU on any device
    (made without `device`, like tensor_split's indices): those that the same samples made for the
    meta device hold on the CPU."""
    import torch

    torch.manual_seed(0)
    out = []
    for sample in op.sample_inputs("cpu", dtype, requires_grad=requires_grad):
        out.append(sample)
        if len(out) >= n:
            break
    try:
        torch.manual_seed(0)
        metas = []
        for sample in op.sample_inputs("meta", dtype, requires_grad=requires_grad):
            metas.append(sample)
            if len(metas) >= len(out):
                break
    except Exception:
        metas = []
    return [(sample, _cpu_leaves(metas[i]) if i < len(metas) else None) for i, sample in enumerate(out)]


def _leaves_of(sample: Any) -> list[Any]:
    from torch.utils._pytree import tree_flatten

    return tree_flatten([sample.input, list(sample.args), dict(sample.kwargs)])[0]


def _cpu_leaves(meta_sample: Any) -> list[bool]:
    import torch

    return [isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in _leaves_of(meta_sample)]


def _on_device(sample: Any, keep: list[bool] | None, requires_grad: bool = False) -> Any:
    """The sample with its tensors moved to the device (but those that stay on the CPU)."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten([sample.input, list(sample.args), dict(sample.kwargs)])
    if keep is None or len(keep) != len(leaves):
        keep = [False] * len(leaves)
    moved = [
        v if k and isinstance(v, torch.Tensor) else _to_remote(v, requires_grad)
        for v, k in zip(leaves, keep, strict=True)
    ]
    inp, args, kwargs = tree_unflatten(moved, spec)
    return type(sample)(inp, args=tuple(args), kwargs=kwargs)


def _call(op: Any, sample: Any) -> Any:
    return op(sample.input, *sample.args, **sample.kwargs)


def _random_ops_mode() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class RandomOps(TorchDispatchMode):
        """Notes whether the CPU reference drew random numbers (a test-only mode, entered briefly)."""

        random = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            if torch.Tag.nondeterministic_seeded in func.tags:
                self.random = True
            return func(*args, **(kwargs or {}))

    return RandomOps


def _RandomOps() -> Any:
    global _random_mode_class
    if _random_mode_class is None:
        _random_mode_class = _random_ops_mode()
    return _random_mode_class()


_random_mode_class: Any = None


def _draws_random_numbers(op: Any, sample: Any) -> bool:
    """Run once more under a mode that notes random ops (not for the reference values: some ops,
    linalg.pinv of complex inputs among them, compute differently when a mode is active)."""
    import torch

    try:
        with _RandomOps() as seen:
            _call(
                op,
                type(sample)(
                    sample.input.clone() if isinstance(sample.input, torch.Tensor) else sample.input,
                    args=sample.args,
                    kwargs=sample.kwargs,
                ),
            )
    except Exception:
        return False
    return seen.random


def _forward(op: Any, sample: Any, keep: list[bool] | None, check_random: bool) -> tuple[bool, bool]:
    """(matched bit for bit, is random). Raises _Skip, AssertionError (wrong) or another error."""
    import torch

    torch.manual_seed(1234)
    try:
        expected = _call(op, sample)
    except Exception as exc:
        raise _Skip(f"the CPU raises: {type(exc).__name__}") from exc
    random = check_random and _draws_random_numbers(op, sample)
    remote_sample = _on_device(sample, keep)
    torch.manual_seed(1234)
    actual = _fetch(_call(op, remote_sample))
    if GPU:  # as test_compare_cpu: what OpInfo says is defined (vectors up to sign), ties by their values
        actual, expected = sample.output_process_fn_grad(actual), sample.output_process_fn_grad(expected)
        actual = _mode_ties(op, sample, _ties_as_expected(op, sample, actual, expected), expected)
        actual = _cuda_statistics(op, actual, expected)
        if random:  # another device's generator: values differ
            _compare(_layouts(actual), _layouts(expected), "output")
            return False, True
    exact = _compare(actual, expected, "output")
    inplace = op.get_inplace()
    if inplace is not None and isinstance(sample.input, torch.Tensor):
        exact &= _forward_inplace(inplace, sample, keep)
    return exact, random


# Ops that return the positions of values they pick, and where: among equal values, CUDA may pick
# another position than the CPU, as PyTorch's own CPU-vs-CUDA test allows. op -> (which output is
# the positions, the `dim` argument's place among the positional arguments after the input, its default)
TIES = {
    "sort": (1, 0, -1),
    "argsort": (0, 0, -1),
    "topk": (1, 1, -1),
    "kthvalue": (1, 1, -1),
    "mode": (1, 0, -1),
    "median": (1, 0, None),
    "nanmedian": (1, 0, None),
    "max": (1, 0, None),
    "min": (1, 0, None),
}


def _argument(sample: Any, name: str, place: int, default: Any) -> Any:
    """A sample's argument after the input, given by name or at its place among the positional ones."""
    return sample.kwargs.get(name, sample.args[place] if len(sample.args) > place else default)


def _ties_as_expected(op: Any, sample: Any, actual: Any, expected: Any) -> Any:
    """The actual result with its positions output replaced by the expected one wherever both
    pick equal values from the input (a tie); a position that picks another value still differs."""
    import torch

    found = TIES.get(op.name)
    if found is None or not isinstance(sample.input, torch.Tensor):
        return actual
    which, place, default = found
    dim = _argument(sample, "dim", place, default)
    outs = list(actual) if isinstance(actual, (tuple, list)) else [actual]
    wanted = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    if not isinstance(dim, int) or which >= min(len(outs), len(wanted)):
        return actual  # (no dim: a whole-tensor reduction, no positions to compare)
    got, want = outs[which], wanted[which]
    if not (isinstance(got, torch.Tensor) and got.dtype == torch.int64 and got.shape == want.shape and got.dim()):
        return actual
    keepdim = got.dim() == sample.input.dim()
    try:
        picked, should = (
            torch.take_along_dim(sample.input, i if keepdim else i.unsqueeze(dim), dim) for i in (got, want)
        )
    except (RuntimeError, IndexError):
        return actual
    outs[which] = torch.where((picked == should).reshape(got.shape), want, got)
    return type(actual)(outs) if isinstance(actual, (tuple, list)) else outs[0]


def _layouts(value: Any) -> Any:
    """The value with each tensor replaced by zeros of its shape and dtype: what can be compared of
    a random op's result across two devices' generators."""
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_layouts(v) for v in value)
    return value


def _mode_ties(op: Any, sample: Any, actual: Any, expected: Any) -> Any:
    """mode's (values, indices) with the expected pair wherever CUDA picked another value that occurs
    as often (a tie among modes, as among positions above), at a position that holds it."""
    import torch

    if op.name != "mode" or not isinstance(sample.input, torch.Tensor) or sample.input.dim() == 0:
        return actual
    dim, keepdim = _argument(sample, "dim", 0, -1), _argument(sample, "keepdim", 1, False)
    (values, indices), (want_values, want_indices) = actual, expected
    x = sample.input

    def along(t: Any) -> Any:
        return t if keepdim else t.unsqueeze(dim)

    def count(v: Any) -> Any:
        return (x == along(v)).sum(dim, keepdim=True)

    try:
        held = torch.take_along_dim(x, along(indices), dim) == along(values)
    except (RuntimeError, IndexError):
        return actual  # (positions out of range: compared as they are, and wrong)
    tie = (count(values) == count(want_values)) & held
    tie = tie if keepdim else tie.squeeze(dim)
    return type(actual)((torch.where(tie, want_values, values), torch.where(tie, want_indices, indices)))


# Ops whose statistics outputs (mean, inverse deviation) CUDA keeps in float32 for half inputs, where
# the CPU returns the input's dtype: op -> the positions of those outputs.
CUDA_FLOAT32_STATISTICS = {  # (those seen on an H100 with torch 2.11; batch norm's others are
    "native_layer_norm": (1, 2),  # excluded by OpInfo's own declarations for CUDA)
    "_batch_norm_with_update": (1, 2),
}


def _cuda_statistics(op: Any, actual: Any, expected: Any) -> Any:
    """The actual result with the statistics that CUDA keeps in float32 (CUDA_FLOAT32_STATISTICS)
    rounded to the half type the CPU returns them in: their values are still compared."""
    import torch

    where = CUDA_FLOAT32_STATISTICS.get(op.name)
    if where is None or not isinstance(expected, (list, tuple)) or not isinstance(actual, (list, tuple)):
        return actual
    out = list(actual)
    for i in where:
        if i < len(out) and i < len(expected) and isinstance(out[i], torch.Tensor):
            want = expected[i]
            half = isinstance(want, torch.Tensor) and want.dtype in (torch.float16, torch.bfloat16)
            if half and out[i].dtype == torch.float32:
                out[i] = out[i].to(want.dtype)
    return type(actual)(out)


def _forward_inplace(inplace: Any, sample: Any, keep: list[bool] | None) -> bool:
    """The in-place variant (squeeze_, transpose_, add_...): the returned tensor and the mutated input."""
    import torch

    local = type(sample)(sample.input.detach().clone(), args=sample.args, kwargs=sample.kwargs)
    torch.manual_seed(1234)
    try:
        expected = _call(inplace, local)
    except Exception:
        return True  # the CPU refuses this sample in place (a dtype or shape it cannot hold)
    remote = _on_device(type(sample)(sample.input.detach().clone(), args=sample.args, kwargs=sample.kwargs), keep)
    torch.manual_seed(1234)
    actual = _call(inplace, remote)
    if isinstance(expected, torch.Tensor) and expected is local.input and actual is not remote.input:
        raise AssertionError("the in-place variant did not return its input")
    exact = _compare(_fetch(actual), expected, "in-place output")
    return _compare(_fetch(remote.input), local.input, "in-place input") and exact


def _grad_inputs(sample: Any) -> list[Any]:
    import torch

    found = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            found.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk([sample.input, list(sample.args), dict(sample.kwargs)])
    return found


def _differentiable(out: Any) -> list[Any]:
    import torch

    flat = out if isinstance(out, (list, tuple)) else [out]
    return [
        t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())
    ]


def _backward(op: Any, sample: Any, keep: list[bool] | None) -> tuple[bool, bool]:
    """(matched bit for bit, is random): the gradients against CPU autograd's."""
    import torch

    torch.manual_seed(1234)
    inputs = _grad_inputs(sample)
    try:
        out = sample.output_process_fn_grad(_call(op, sample))
        outs = _differentiable(out)
        if not inputs or not outs:
            raise _Skip("no differentiable output")
        torch.manual_seed(99)
        cotangents = [torch.randn_like(t) for t in outs]
        expected = torch.autograd.grad(outs, inputs, cotangents, allow_unused=True)
    except _Skip:
        raise
    except Exception as exc:
        raise _Skip(f"the CPU raises: {type(exc).__name__}") from exc
    rs = _on_device(sample, keep, requires_grad=True)
    torch.manual_seed(1234)
    r_inputs = _grad_inputs(rs)
    r_outs = _differentiable(sample.output_process_fn_grad(_call(op, rs)))
    if len(r_outs) != len(outs) or len(r_inputs) != len(inputs):
        raise AssertionError(
            f"{len(r_outs)} differentiable outputs for {len(r_inputs)} inputs instead of {len(outs)} for {len(inputs)}"
        )
    grads = _fetch(list(torch.autograd.grad(r_outs, r_inputs, [c.to(DEV) for c in cotangents], allow_unused=True)))
    if GPU and _draws_random_numbers(op, sample):  # (rrelu, dropouts in training): another generator
        _compare(_layouts(grads), _layouts(list(expected)), "gradient")
        return False, True
    return _compare(grads, list(expected), "gradient"), False


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return " ".join(line.strip() for line in text[:5])[:400]


def compare_cpu_exemption(op: Any, device_type: str | None = None, dtype: Any = None) -> str | None:
    """Why OpInfo does not compare this op's results with the CPU's (its skips and expected failures
    of TestCommon.test_compare_cpu, for all devices or `device_type`, all dtypes or `dtype`), or None."""
    for info in op.decorators:
        if getattr(info, "cls_name", None) != "TestCommon" or info.test_name != "test_compare_cpu":
            continue
        if info.device_type not in (None, device_type) or (info.dtypes is not None and dtype not in info.dtypes):
            continue
        if info.active_if is not None and not info.active_if:
            continue
        for decorator in info.decorators:
            cells = [c.cell_contents for c in getattr(decorator, "__closure__", None) or ()]
            reasons = [c for c in cells if isinstance(c, str)]
            return reasons[0] if reasons else getattr(decorator, "__name__", "declared")
    return None


# The ops whose output is uninitialized memory, as torch 2.15's OpInfo flags them
# (has_nondeterministic_output), for an OpInfo without the flag (torch 2.11's)
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})


def _nondeterministic(op: Any) -> bool:
    """Whether the op's output is not a function of its inputs (uninitialized memory)."""
    flag = getattr(op, "has_nondeterministic_output", None)
    return bool(flag) if flag is not None else op.name in UNINITIALIZED


def run_op(op: Any) -> dict[str, Any]:
    import torch

    result: dict[str, Any] = {
        "op": _op_id(op),
        "random": False,
        "nondeterministic": _nondeterministic(op),
    }
    forward: dict[str, Any] = {"status": "skip", "samples": 0, "exact": True, "dtypes": []}
    supported = op.supported_dtypes("cpu")
    if GPU:  # as PyTorch's CUDA tests: the dtypes CUDA implements, less what OpInfo says not to compare
        supported = supported & op.supported_dtypes("cuda")
    for name, n in SAMPLES.items():
        dtype = getattr(torch, name)
        if dtype not in supported:
            continue
        declared = compare_cpu_exemption(op, "cuda", dtype) if GPU else None
        if declared is not None:
            result.setdefault("declared", {})[name] = declared
            continue
        try:
            samples = _samples(op, dtype, n, requires_grad=False)
        except Exception as exc:
            forward.setdefault("notes", []).append(f"{name}: no samples ({type(exc).__name__})")
            continue
        for sample, keep in samples:
            try:
                exact, random = _forward(op, sample, keep, check_random=GPU or forward["samples"] == 0)
            except _Skip:
                continue
            except AssertionError as exc:
                forward.update(status="wrong", reason=f"{name}: {_reason(exc)}")
                break
            except Exception as exc:
                forward.update(status="error", reason=f"{name}: {_reason(exc)}")
                break
            forward["samples"] += 1
            forward["exact"] &= exact
            result["random"] |= random
            if name not in forward["dtypes"]:
                forward["dtypes"].append(name)
            if forward["status"] == "skip":
                forward["status"] = "match"
        if forward["status"] in ("wrong", "error"):
            break
    result["forward"] = forward
    if op.supports_autograd and torch.float32 in op.supported_backward_dtypes("cpu"):
        backward: dict[str, Any] = {"status": "skip", "samples": 0, "exact": True}
        try:
            samples = _samples(op, torch.float32, GRAD_SAMPLES, requires_grad=True)
        except Exception as exc:
            samples = []
            backward["notes"] = [f"no samples ({type(exc).__name__})"]
        for sample, keep in samples:
            try:
                exact, random = _backward(op, sample, keep)
                result["random"] |= random
            except _Skip:
                continue
            except AssertionError as exc:
                backward.update(status="wrong", reason=_reason(exc))
                break
            except Exception as exc:
                backward.update(status="error", reason=_reason(exc))
                break
            backward["samples"] += 1
            backward["exact"] &= exact
            backward["status"] = "match"
        result["backward"] = backward
    return result


def _database(kind: str) -> tuple[dict[str, Any], Any]:
    """The entries by name, and the function that runs one: PyTorch's op_db, or its module_db
    (module_conformance.py)."""
    if kind == "modules":
        import module_conformance
        from torch.testing._internal.common_modules import module_db

        return {m.formatted_name: m for m in module_db}, module_conformance.run_module
    from torch.testing._internal.common_methods_invocations import op_db

    return {_op_id(op): op for op in op_db}, run_op


def child(address: str, token: str, kind: str = "ops") -> None:
    """Answer one JSON line per entry name read from stdin."""
    warnings.filterwarnings("ignore")
    import torch

    import genie_core
    from genie_core.errors import ConnectionLost

    genie_core.init_sync(address, token=token, timeout=30)
    if GPU:  # full float32 matmuls and convolutions on the server, as PyTorch's CUDA tests run them
        off = "import torch; torch.backends.cuda.matmul.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = False"
        reply = genie_core.get_cluster_state().client.execute(off).wait(60).content
        if reply.get("status") != "ok":
            raise RuntimeError(f"could not turn TF32 off on the server: {reply}")
    ops, run_one = _database(kind)
    torch.set_num_threads(1)
    out = sys.stdout
    sys.stdout = sys.stderr  # ops that print must not garble the answers
    out.write(json.dumps({"ready": sorted(ops)}) + "\n")
    out.flush()
    for line in sys.stdin:
        name = line.strip()
        start = time.perf_counter()
        try:
            result = run_one(ops[name])
        except ConnectionLost as exc:
            result = {"op": name, "lost": _reason(exc)}
        except Exception as exc:
            result = {"op": name, "harness": _reason(exc), "trace": traceback.format_exc()[-2000:]}
        result["seconds"] = round(time.perf_counter() - start, 3)
        out.write(json.dumps(result) + "\n")
        out.flush()
        if "lost" in result:
            return  # the session is gone: a new child starts a new one


# -- parent -----------------------------------------------------------------------------------
class _Child:
    def __init__(self, address: str, token: str, gpu: bool = False, kind: str = "ops") -> None:
        env = dict(os.environ, GENIE_CONFORMANCE_DEVICE="gpu" if gpu else "cpu")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", address, token, kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.lines.get(timeout=180)
        if ready is None:
            raise RuntimeError("a conformance child did not start")
        self.ops = json.loads(ready)["ready"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, name: str, timeout: float) -> dict[str, Any] | None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(name + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=timeout)
        except (BrokenPipeError, queue.Empty):
            line = None
        return json.loads(line) if line else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def run(
    address: str, token: str, workers: int = 2, only: list[str] | None = None, gpu: bool = False, kind: str = "ops"
) -> list[dict[str, Any]]:
    """Every entry of op_db (or of module_db, `kind="modules"`; or `only` these), in a pool of child
    processes; a dead or hung child is a crash. `gpu`: the server computes on a GPU, so values are
    compared within tolerance."""
    first = _Child(address, token, gpu, kind)
    names = [n for n in first.ops if only is None or n in only]
    todo: queue.Queue[str] = queue.Queue()
    for n in names:
        todo.put(n)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    progress = os.environ.get("GENIE_CONFORMANCE_PROGRESS")

    def slot(child: _Child | None) -> None:
        while True:
            try:
                name = todo.get_nowait()
            except queue.Empty:
                break
            if child is None:
                child = _Child(address, token, gpu, kind)
            start = time.perf_counter()
            answer = child.ask(name, OP_TIMEOUT_S)
            if answer is None or "lost" in answer:
                seconds = time.perf_counter() - start
                code = child.proc.poll()
                why = (
                    f"hung (killed after {seconds:.0f} s)"
                    if code is None
                    else (
                        f"the client process died (exit code {code})"
                        if answer is None
                        else f"the session was lost: {answer['lost']}"
                    )
                )
                child.stop()
                child = None
                answer = {"op": name, "crash": why, "seconds": round(seconds, 3)}
            with lock:
                results.append(answer)
                if progress:  # each result as it comes: a run ended at a limit keeps what it did
                    with open(progress, "a") as fh:
                        fh.write(json.dumps(answer) + "\n")
        if child is not None:
            child.stop()

    threads = [threading.Thread(target=slot, args=(first if i == 0 else None,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(results, key=lambda r: r["op"])


# -- the report -----------------------------------------------------------------------------
def outcome(result: dict[str, Any], mode: str) -> tuple[str, str]:
    """(status, reason) of one op in one mode: match, wrong, error, crash, skip, or excluded."""
    if "crash" in result:
        return "crash", result["crash"]
    if "harness" in result:
        return "error", "harness: " + result["harness"]
    part = result.get(mode)
    if part is None:
        return "n/a", ""
    if result.get("nondeterministic"):
        return "excluded", "nondeterministic output"
    if result.get("random") and part["status"] not in ("wrong", "error"):  # (a random op's layouts, or
        return "excluded", "random"  # its deterministic samples' values, can still be wrong)
    if part["status"] == "skip" and result.get("declared"):  # OpInfo's own word: not comparable with the CPU
        return "excluded", "; ".join(f"{dtype}: {why}" for dtype, why in result["declared"].items())
    return part["status"], part.get("reason", "")


def rates(results: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode in ("forward", "backward"):
        counts: dict[str, int] = {}
        for r in results:
            status, _ = outcome(r, mode)
            counts[status] = counts.get(status, 0) + 1
        tested = sum(counts.get(s, 0) for s in ("match", "wrong", "error", "crash"))
        summary[mode] = {
            "counts": counts,
            "tested": tested,
            "rate": counts.get("match", 0) / tested if tested else 0.0,
            "exact": sum(1 for r in results if outcome(r, mode)[0] == "match" and r[mode].get("exact")),
        }
    return summary


if __name__ == "__main__":
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--child":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # module_conformance beside it
        child(sys.argv[2], sys.argv[3], *sys.argv[4:])


def document(
    results: list[dict[str, Any]], seconds: float, server: str, title: str = "PyTorch OpInfo database", workers: int = 2
) -> str:
    """The OpInfo part of docs/CONFORMANCE.md: rates, then every op that did not match, and why."""
    import platform

    import torch

    r = rates(results)
    f, b = r["forward"], r["backward"]
    random_ops = [x for x in results if x.get("random") and not x.get("nondeterministic")]
    random_match = sum(1 for x in random_ops if x.get("forward", {}).get("status") == "match")
    lines = [
        f"## {title}",
        "",
        f"Measured by `tests/test_conformance_opinfo.py` ({len(results)} entries of `op_db`, "
        f"torch {torch.__version__}, Python {platform.python_version()}, server device: {server}; "
        f"{seconds:.0f} s with {workers} client processes). "
        "Each op's first samples run on `remote_accelerator` and on the CPU: "
        f"{', '.join(f'{n} {k}' for k, n in SAMPLES.items())} sample(s) per dtype "
        "(the dtypes the op supports on the CPU; float32, float16, bfloat16, int64 and bool, plus complex64), "
        "each through the op and its in-place variant; "
        f"gradients from the first {GRAD_SAMPLES} float32 samples with requires_grad=True, against CPU autograd. "
        "Values must agree within `torch.testing.assert_close`'s default tolerance for the dtype "
        "(exactly, for integers and bools), shapes and dtypes exactly, "
        "and each output's shape and dtype as the server holds it must be what the client believes. "
        "Every op ran in a child process; a process or session that died counts as a crash of that op.",
        "",
        "| | ops tested | match | bit-exact | wrong | raise | crash | rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, part in (("forward", f), ("backward", b)):
        c = part["counts"]
        lines.append(
            f"| {name} | {part['tested']} | {c.get('match', 0)} | {part['exact']} | {c.get('wrong', 0)} | "
            f"{c.get('error', 0)} | {c.get('crash', 0)} | {100 * part['rate']:.1f}% |"
        )
    lines += [
        "",
        "Not counted above: ops with nondeterministic output (uninitialized memory: "
        f"{', '.join(sorted(x['op'] for x in results if x.get('nondeterministic')))}); "
        f"random ops ({len(random_ops)}), which draw from the device's generator: "
        + (
            f"seeded alike, on this CPU server {random_match} of them give the CPU's values exactly; "
            "on a GPU server they cannot. "
            if server == "CPU"
            else "on a GPU server their values cannot be the CPU's: their samples that draw random numbers "
            "are compared by shapes and dtypes, the others by value. "
        )
        + "Skipped: ops whose samples the CPU itself cannot run "
        "in these dtypes (CUDA-only ops, and a few whose CPU kernels refuse every sample):",
        "",
    ]
    for mode in ("forward", "backward"):
        skipped = [x["op"] for x in results if outcome(x, mode)[0] == "skip"]
        lines.append(f"- {mode}: {', '.join(skipped) if skipped else 'none'}")
    declared = [x for x in results if x.get("declared")]
    if declared:
        lines += [
            "",
            "Not compared in some dtypes, as OpInfo declares for CUDA (its skips and expected failures of "
            "`TestCommon.test_compare_cpu`; an op left with no dtype counts as excluded):",
            "",
            *[f"- {x['op']}: " + "; ".join(f"{d}: {why}" for d, why in x["declared"].items()) for x in declared],
        ]
    lines += ["", "Ops that raise (each with its reason) or give wrong results:", ""]
    failing = [
        (x["op"], mode, *outcome(x, mode))
        for x in results
        for mode in ("forward", "backward")
        if outcome(x, mode)[0] in ("wrong", "error", "crash")
    ]
    if not failing:
        lines.append("- none")
    for op, mode, status, why in failing:
        lines.append(f"- `{op}` ({mode}, {status}): {why}")
    lines.append("")
    return "\n".join(lines)


def write_section(name: str, text: str) -> None:
    """Write one section of CONFORMANCE.md (the committed one or the run's copy: reliability.measured_doc)."""
    from reliability import measured_doc

    replace_section(measured_doc("CONFORMANCE.md"), name, text)


def replace_section(path: Any, name: str, text: str) -> None:
    """Put `text` between this section's markers in the file (made with a title if missing)."""
    from pathlib import Path

    path = Path(path)
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    old = (
        path.read_text()
        if path.exists()
        else (
            "# Conformance: remote_accelerator against eager CPU\n\n"
            "Written by the conformance tests; do not edit by hand.\n"
        )
    )
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in old and end in old:
        new = old[: old.index(begin)] + block + old[old.index(end) + len(end) :]
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    path.write_text(new)
