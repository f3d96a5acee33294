"""The fused host step's loop without holding the GIL (DeepSpeed 0.19).

DeepSpeed binds `adam_update` without releasing the GIL, so a thread running it stops every other Python
thread for the whole call (~60 ms per rank per step on GPT-2 medium), and a Python loop over chunks takes
the GIL back between every call. overlap.py runs the host step on a worker thread beside the next forward,
which is Python-bound; the worker must not need the GIL while it works. This is fusedstep.Update.run's
loop in C++ (the same unscale and cast calls) around the very function DeepSpeed's extension exports
(`ds_adam_step`, resolved at load time from the extension already loaded: the same compiled code and the
same optimizer objects), built once per torch/DeepSpeed build with torch's JIT extension loader and
cached like DeepSpeed's own.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, Callable

log = logging.getLogger("z3guard")

_SOURCE = r"""
int ds_adam_step(int optimizer_id, size_t step, float lr, float beta1, float beta2, float epsilon,
                 float weight_decay, bool bias_correction, torch::Tensor& params, torch::Tensor& grads,
                 torch::Tensor& exp_avg, torch::Tensor& exp_avg_sq) __attribute__((weak));

static bool linked() { return ds_adam_step != nullptr; }

// fusedstep.Update.run's loop, with the GIL released for all of it: per chunk the unscale (the same
// mul_ as Python's, by a 0-dim tensor or by a Python float), DeepSpeed's Adam, the cast into `low`.
static void fused_range(int optimizer_id, size_t step, float lr, float beta1, float beta2, float epsilon,
                        float weight_decay, bool bias_correction, torch::Tensor param, torch::Tensor grad,
                        torch::Tensor exp_avg, torch::Tensor exp_avg_sq, torch::Tensor low,
                        c10::optional<torch::Tensor> factor_tensor, double factor, int64_t start, int64_t end,
                        int64_t chunk) {
  for (int64_t lo = start; lo < end; lo += chunk) {
    int64_t hi = std::min(lo + chunk, end);
    auto g = grad.slice(0, lo, hi), p = param.slice(0, lo, hi);
    auto m = exp_avg.slice(0, lo, hi), v = exp_avg_sq.slice(0, lo, hi);
    if (factor_tensor) g.mul_(*factor_tensor); else g.mul_(at::Scalar(factor));
    ds_adam_step(optimizer_id, step, lr, beta1, beta2, epsilon, weight_decay, bias_correction, p, g, m, v);
    low.slice(0, lo, hi).copy_(p);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linked", &linked);
  m.def("fused_range", &fused_range, pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""

_loaded: dict[str, Any] = {}  # DeepSpeed extension path -> our binding (or None: could not be built)


def fused_range(adam: Any) -> Callable | None:
    """fusedstep.Update.run's loop in C++ for DeepSpeedCPUAdam `adam`'s extension, releasing the GIL; None
    where it cannot be built here (no compiler, a DeepSpeed extension without the symbol): callers then
    keep the step synchronous."""
    path = getattr(adam.ds_opt_adam, "__file__", None)
    if path is None:
        return None
    if path not in _loaded:
        _loaded[path] = _build(path)
    module = _loaded[path]
    return None if module is None else module.fused_range


def _build(path: str) -> Any | None:
    from torch.utils.cpp_extension import load_inline

    try:
        # Make the loaded extension's symbols visible to libraries loaded after it (no second copy).
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL | os.RTLD_NOW)
        module = load_inline("z3guard_fused_range", cpp_sources=[_SOURCE], extra_cflags=["-O2"])
    except Exception as exc:  # a build failure only costs the overlap
        log.warning("z3guard: DeepSpeedCPUAdam's kernel without the GIL could not be built (%s); the host "
                    "optimizer step stays synchronous", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    if not module.linked():
        log.warning("z3guard: %s exports no ds_adam_step; the host optimizer step stays synchronous", path)
        return None
    return module
