"""The optimizer step's gradient norm without optimizer offload (DeepSpeed 0.19), with fewer launches.

Stage 3 takes each gradient partition's L2 norm in fp64, one cast and one reduction per parameter
(`get_grad_norm_direct`): 584 kernels for GPT-2 medium's 292 parameters, and without offload the GPU
waits for the host to launch them. Here each gradient still gets those two kernels, on the same input:
on CUDA, those of the small gradients (biases, norms: two thirds of a transformer's parameters, a tiny
share of its elements) are recorded once into a CUDA graph and replayed, which launches them all at
once; the large ones run as stock runs them, since their kernels outlast their launch. The same kernels
on the same inputs give the same norms, and the sum, the all-reduce, the root and the inf/NaN mask
after them are stock's expressions in stock's order. Only the plain data-parallel case: with a
model-parallel group, AutoEP experts, another norm type or gradients off the device, stock's code runs.
"""
from __future__ import annotations

import logging
import types
from typing import Any

import torch

from . import speedpaths

PATCHED = ("get_grad_norm_direct",)  # set by apply
SMALL_NUMEL = 1 << 20
"""Gradients below this many elements are normed inside the graph. The graph keeps the fp64 copy of one
such gradient (8 MiB at most) for good; the larger ones, whose copies stock frees at once, run outside."""
MIN_SMALL = 8  # fewer small gradients than this: no graph, nothing much to save


def why_off(opt: Any) -> str | None:
    """None where stage 3's norm comes from `get_grad_norm_direct` in the plain data-parallel case."""
    if getattr(opt, "offload_optimizer", False):
        return "with offload_optimizer (the norm is taken in the backward there)"
    if getattr(opt, "model_parallel_group", None) is not None or getattr(opt, "model_parallel_rank", 0) != 0:
        return "with a model-parallel group"
    return None


def apply(opt: Any) -> None:
    opt.z3guard_stock_grad_norm = opt.get_grad_norm_direct
    opt.z3guard_norm_graphs = {}  # (data_ptr, shape, dtype) of a group's gradients -> None (seen once) or
    # (indices of the small ones, their _Graph); None itself once the path went eager for good
    opt.get_grad_norm_direct = types.MethodType(_grad_norm_direct, opt)


class _Graph:
    """The small gradients' norms of one parameter group, recorded once; `replay` writes `norms`."""

    def __init__(self, small: list[torch.Tensor], norm_dtype: torch.dtype) -> None:
        self.norms = torch.empty(len(small), dtype=norm_dtype, device=small[0].device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            for i, g in enumerate(small):
                self.norms[i].copy_(_stock_norm(g, norm_dtype))

    def replay(self) -> None:
        self.graph.replay()


def _grad_norm_direct(self, gradients, params, norm_type=2):
    # DeepSpeed 0.19's `get_grad_norm_direct` for an L2 norm without model or expert parallelism.
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().device_name()
    if (float(norm_type) != 2.0 or not gradients or self._autoep_expert_parallel_group(params) is not None
            or any(g.device.type != gradients[0].device.type for g in gradients)
            or gradients[0].device.type != torch.device(device).type):
        return self.z3guard_stock_grad_norm(gradients, params, norm_type)
    self._assert_same_partition_group(params)
    process_group = self._get_param_partition_group(params[0])
    norm_dtype = _norm_dtype()
    grad_norms = _norms(self, gradients, norm_dtype)
    total_norm_cuda = torch.sum(torch.pow(torch.stack(grad_norms), 2.0))
    dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=process_group)
    total_norm = total_norm_cuda**(1. / 2.0)
    inf_or_nan = total_norm.isnan().logical_or(total_norm.isinf())
    err = torch.tensor(-1.0, device=self.device, dtype=torch.float)
    return torch.where(inf_or_nan, err, total_norm)


def _norm_dtype() -> torch.dtype:
    try:  # 0.19.6 and later: fp32 on devices without fp64
        from deepspeed.runtime.zero.utils import get_norm_dtype
    except ImportError:  # before: `.double()`
        return torch.float64
    return get_norm_dtype()


def _stock_norm(g: torch.Tensor, norm_dtype: torch.dtype) -> torch.Tensor:
    """One gradient's norm as stock takes it: a cast, then a reduction."""
    return g.to(norm_dtype).norm(2.0)


def _norms(self, gradients: list[torch.Tensor], norm_dtype: torch.dtype) -> list[torch.Tensor]:
    """Each gradient's norm as stock takes it; on CUDA the small ones by replaying a graph recorded at the
    second step that brings the same gradient tensors."""
    graphs = self.z3guard_norm_graphs
    if not gradients[0].is_cuda or graphs is None:
        return [_stock_norm(g, norm_dtype) for g in gradients]
    key = tuple((g.data_ptr(), g.shape, g.dtype) for g in gradients)
    if key not in graphs:
        if len(graphs) < len(self.fp16_groups):
            graphs[key] = None  # seen once: the next step with them records (this one warmed the kernels)
        else:  # gradient tensors that change between steps: eager for good
            self.z3guard_norm_graphs = None
        return [_stock_norm(g, norm_dtype) for g in gradients]
    if graphs[key] is None:
        graphs[key] = _record(gradients, norm_dtype)
        if graphs[key] is None:  # no graph here: eager for good
            self.z3guard_norm_graphs = None
            return [_stock_norm(g, norm_dtype) for g in gradients]
    small, graph = graphs[key]
    graph.replay()
    norms = [None] * len(gradients)
    for j, i in enumerate(small):
        norms[i] = graph.norms[j]
    return [_stock_norm(g, norm_dtype) if n is None else n for g, n in zip(gradients, norms)]


def _record(gradients: list[torch.Tensor], norm_dtype: torch.dtype) -> tuple[list[int], _Graph] | None:
    small = [i for i, g in enumerate(gradients) if g.numel() < SMALL_NUMEL]
    if len(small) < MIN_SMALL:
        return None
    stream = torch.cuda.current_stream()
    try:
        return small, _Graph([gradients[i] for i in small], norm_dtype)
    except Exception as exc:  # this path alone goes eager; the norms are stock's either way
        torch.cuda.set_stream(stream)  # a capture that failed at its end leaves its side stream current
        speedpaths.say_off("grad_norm", f"here: its CUDA graph could not be recorded ({exc})", logging.WARNING)
        return None
