"""`offload_optimizer`'s gradients on their way to the host, and their global norm (DeepSpeed 0.19).

- In the backward, stage 3 copies each gradient partition into the host buffer and then copies that
  region back to the device (`.to(device)`), where it takes the norm and casts the gradient into the
  fp32 gradients on the host: a host-to-device copy of every gradient on every step (355 MB per rank on
  GPT-2 medium) and a device allocation per parameter. The partition it copied from is still on the
  device and holds the same values (same dtype: the bytes are copied, not converted), so at a boundary's
  first micro-step, the one that copies rather than accumulates, the norm and the cast read it instead.
  Beside the fused step, the fp32 gradient is not copied over at all: it is the host region, cast, and
  the fused step casts it there (hostgrads.py).
- At the step, the global norm adds up the per-parameter norms with two device ops each
  (`total += norm ** 2`, 784 launches on GPT-2 medium) before reading the sum back. Here the squares are
  taken in one op and added on the host, in the same order and precision: the same IEEE additions give
  the same bits.

Anything else (accumulation, NVMe-swapped optimizer state, a conversion between dtypes, norms that are
not one device's scalars) runs stock's code.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import numpy as np
import torch

from . import hostgrads, overflow
from .common import S3

PATCHED = ("partition_grads", "complete_grad_norm_calculation_for_cpu_offload")  # set by apply
REGIONS = S3 + "param_id_to_grad_partition"


def applicable(opt: Any) -> bool:
    """On plain stage 3 (fastpaths._is_plain_stage3, which leaves ZenFlow out) with host optimizer state."""
    return (bool(getattr(opt, "offload_optimizer", False)) and not getattr(opt, "swap_optimizer", False)
            and hasattr(opt, REGIONS) and hasattr(opt, "_offload_boundary_param_ids"))


def apply(opt: Any) -> None:
    """Before overflow.apply, whose note-keeping wraps the `partition_grads` set here."""
    from deepspeed.utils.nvtx import instrument_w_nvtx

    opt.z3guard_grad_offload = {"from_device": 0, "copied_back": 0, "cast_on_host": 0,  # what ran
                                "norms_summed_on_host": 0}
    opt.z3guard_stock_partition_grads_to_host = opt.partition_grads
    opt.partition_grads = types.MethodType(instrument_w_nvtx(_partition_grads), opt)  # stock's range, kept
    opt.z3guard_stock_offload_norm = opt.complete_grad_norm_calculation_for_cpu_offload
    opt.complete_grad_norm_calculation_for_cpu_offload = types.MethodType(_offload_norm, opt)


def switch(opt: Any) -> Callable[[bool], None]:
    """A toggle between this module's two methods and stock's on one engine, between steps: an A/B whose
    halves interleave (bench/profile_step.py --alternate), so a host's drift falls on both alike. The
    backward's method is the one overflow.py's wrapper calls; stock's writes the fp32 gradients itself,
    so nothing may stay noted when it takes over."""
    if not hasattr(opt, "z3guard_stock_partition_grads_to_host"):
        raise ValueError("fast_grad_offload is not applied to this engine (offload_optimizer with z3guard's "
                         "fast paths is needed)")
    fast = (opt.z3guard_stock_partition_grads, opt.complete_grad_norm_calculation_for_cpu_offload)
    stock = (opt.z3guard_stock_partition_grads_to_host, opt.z3guard_stock_offload_norm)

    def use(on: bool) -> None:
        if not on:
            hostgrads.materialise(opt)
        opt.z3guard_stock_partition_grads, opt.complete_grad_norm_calculation_for_cpu_offload = fast if on else stock

    return use


def _partition_grads(self, params_to_release: list, grad_partitions: list) -> list:
    # DeepSpeed 0.19's `partition_grads` at a boundary's first micro-step, without the copy back.
    if self.micro_step_id != 0 or not self.is_gradient_accumulation_boundary():
        hostgrads.materialise(self, params=params_to_release)  # before stock's writes their regions again
        return self.z3guard_stock_partition_grads_to_host(params_to_release, grad_partitions)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.utils import get_norm_dtype

    regions, synchronized = getattr(self, REGIONS), get_accelerator().is_synchronized_device()
    lazy = getattr(self, "z3guard_lazy", None)
    norm_dtype = get_norm_dtype()
    buffers = []
    for param, grad_partition in zip(params_to_release, grad_partitions):
        if not param.partition_numel() * self._get_param_partition_rank(param) < param.ds_numel:
            param.grad = None  # an empty partition: nothing to do
            continue
        self._offload_boundary_param_ids.add(param.ds_id)
        region = regions[param.ds_id].narrow(0, 0, grad_partition.numel())
        buffers.append(region)
        region.copy_(grad_partition, non_blocking=True)
        # Same dtype: the region holds the partition's bytes. And the norm must start with a cast (as it
        # does from fp16/bf16 gradients), so that it reduces a fresh tensor as stock's does, not a view.
        if grad_partition.dtype == region.dtype != norm_dtype and grad_partition.is_contiguous():
            on_device, counted = grad_partition.view(-1), "from_device"
        else:  # stock's copy back
            on_device, counted = region.to(grad_partition.device, non_blocking=True), "copied_back"
        self.z3guard_grad_offload[counted] += 1
        if counted == "from_device" and lazy is not None:  # the fp32 gradient: the region, cast (hostgrads.py)
            self.norm_for_param_grads[self.get_param_id(param)] = self._constant_buffered_norm2(on_device)
            overflow.note_norm(self, param, on_device.numel())  # as its wrapper of the stock path does
            hostgrads.defer(self, param, region)
            self.z3guard_grad_offload["cast_on_host"] += 1
        else:
            hostgrads.materialise(self, params=[param])  # a note left from an earlier step: stock writes now
            self._offload_grad_partition_at_boundary(param, on_device, {}, {})
        if not synchronized and param.grad is not None:
            param.grad.record_stream(get_accelerator().current_stream())
        param.grad = None
    return buffers


def _offload_norm(self, params: list):
    # DeepSpeed 0.19's `complete_grad_norm_calculation_for_cpu_offload`, its sum of squares on the host.
    from deepspeed.runtime.zero import stage3 as s3  # its names, as stock's code sees them

    self._assert_same_partition_group(params)
    process_group = self._get_param_partition_group(params[0])
    counts_every_rank = self._grad_norm_counts_every_rank(params, process_group)
    norms = [self.norm_for_param_grads[self.get_param_id(p)] for p in params
             if (counts_every_rank or s3.is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
             and self.get_param_id(p) in self.norm_for_param_grads]
    if not _one_device_scalars(norms):
        return self.z3guard_stock_offload_norm(params)
    self.z3guard_grad_offload["norms_summed_on_host"] += 1
    total_norm_cuda = s3.get_accelerator().FloatTensor([sum_of_squares(norms)])
    s3.dist.all_reduce(total_norm_cuda, op=s3.dist.ReduceOp.SUM, group=process_group)
    if not counts_every_rank:
        self._model_parallel_all_reduce(tensor=total_norm_cuda, op=s3.dist.ReduceOp.SUM)
    autoep_ep_group = self._autoep_expert_parallel_group(params)
    if s3.pg_utils.is_parallel(autoep_ep_group):
        s3.dist.all_reduce(total_norm_cuda, op=s3.dist.ReduceOp.SUM, group=autoep_ep_group)
    total_norm = total_norm_cuda[0]**(1. / 2.0)
    s3.mask_nan_or_inf_with_val_inplace(total_norm, device=total_norm.device)
    return total_norm.cpu()


def sum_of_squares(norms: list[torch.Tensor]) -> float:
    """Stock's `total = 0.0; for n in norms: total += n ** 2` (device ops in the norms' dtype, then
    `float(total)`), with one device op and one read: the squares are the same elementwise op, and the
    additions run on the host in the same order and precision."""
    squares = (torch.stack([n.reshape(()) for n in norms]) ** 2).cpu().numpy()
    total = squares.dtype.type(0.0)
    with np.errstate(all="ignore"):  # an fp32 sum past its range is inf, silently, as on the device
        for square in squares:
            total = total + square
    return float(total)


def _one_device_scalars(norms: list) -> bool:
    """Tensors of one element, one device and one float dtype: what stage 3's backward stores."""
    if not norms or not all(isinstance(n, torch.Tensor) and n.numel() == 1 for n in norms):
        return False
    first = norms[0]
    return first.dtype in (torch.float64, torch.float32) and all(
        n.device == first.device and n.dtype == first.dtype for n in norms)
