"""The floors under a remote op's client cost, on this torch: what an op costs run locally, through a
do-nothing `__torch_dispatch__` wrapper subclass (genie's route today), and through a do-nothing C++
`PrivateUse1` boxed fallback (the route of PyTorch's open-registration example). Run in a process
of its own (`python -m benchmarks._dispatch_floors [--quick]`, JSON on stdout): the fallback is
registered for PrivateUse1, which genie's device also uses."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

# A boxed fallback for every op on PrivateUse1 that does no work: the output is a storage-less
# tensor with the first tensor argument's dtype and shape. What is left is the cost of getting
# from Python to a backend kernel and back with a fresh output.
_FALLBACK = r"""
#include <torch/extension.h>
#include <torch/library.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
void do_nothing(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size(), nrets = schema.returns().size();
  at::Tensor like;
  for (size_t i = stack->size() - nargs; i < stack->size(); ++i) {
    if ((*stack)[i].isTensor()) { like = (*stack)[i].toTensor(); break; }
  }
  torch::jit::drop(*stack, nargs);
  const bool known = like.defined();  // a factory has no tensor argument: a 0-dim float then
  for (size_t i = 0; i < nrets; ++i) {
    auto out = at::detail::make_tensor<c10::TensorImpl>(
        c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
        known ? like.dtype() : caffe2::TypeMeta::Make<float>(), c10::Device(c10::DeviceType::PrivateUse1, 0));
    out.unsafeGetTensorImpl()->set_sizes_contiguous(known ? like.sizes() : c10::IntArrayRef{});
    torch::jit::push(*stack, std::move(out));
  }
}
}  // namespace

at::Tensor make(std::vector<int64_t> sizes) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), caffe2::TypeMeta::Make<float>(),
      c10::Device(c10::DeviceType::PrivateUse1, 0));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::PrivateUse1>);

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&do_nothing>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("make", &make); }
"""


class Wrapper(torch.Tensor):
    """A wrapper subclass whose every op does nothing but make a fresh output like its input."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device="meta")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return Wrapper(args[0])


def per_op_us(x: torch.Tensor, n: int, runs: int) -> float:
    """Median over `runs` of the time per `x + 1`, in microseconds."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(n):
            _ = x + 1
        times.append((time.perf_counter() - start) / n * 1e6)
    return round(statistics.median(times), 2)


def fallback_module():
    """The C++ fallback, built once per torch and source (torch's extension cache), or None where
    no compiler is at hand (the reason on stderr)."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline("genie_dispatch_floor", _FALLBACK, extra_cflags=["-O2"], verbose=False)
    except Exception as exc:  # no compiler, no headers: the floor is then unmeasured, and says so
        print(f"C++ fallback not built: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", file=sys.stderr)
        return None


def main(quick: bool) -> dict:
    n, runs = (2_000, 5) if quick else (20_000, 9)
    local = torch.zeros(64)
    out = {
        "torch": torch.__version__,
        "local_cpu_us": per_op_us(local, n, runs),
        "python_dispatch_subclass_us": per_op_us(Wrapper(local), n, runs),
    }
    if torch.cuda.is_available():  # launches in a loop (asynchronous): a local GPU's rate of small ops,
        on_gpu = torch.zeros(64, device="cuda")  # which the GPU itself may bound once the launch queue fills
        per_op_us(on_gpu, n // 10, 1)  # (CUDA's first launches: context, kernels loaded)
        torch.cuda.synchronize()
        out["local_cuda_us"] = per_op_us(on_gpu, n, runs)
        torch.cuda.synchronize()
    if quick:  # building the extension takes a minute on two cores: full runs only
        out["cpp_privateuse1_fallback_us"] = "full run only"
        return out
    ext = fallback_module()
    out["cpp_privateuse1_fallback_us"] = per_op_us(ext.make([64]), n, runs) if ext else "not built (no compiler)"
    return out


if __name__ == "__main__":
    print(json.dumps(main("--quick" in sys.argv)))
