"""Faster, bit-identical replacements for ZeRO-3's CPU-offload hot paths (DeepSpeed 0.19), applied from
here; the fused host step (fusedstep.py) and the gradients (gradoffload.py, hostgrads.py) have modules of
their own.

- write-back: stage 3 copies each updated fp32 master partition into the fp16/bf16 flat buffer of the
  parameters with one `copy_`. With `offload_param` the destination is pinned host memory and the source
  sits on the GPU, and a cross-device, cross-dtype copy makes PyTorch allocate a pageable fp32 host
  temporary as large as the partition, every step. Here the cast runs on the device, chunk by chunk
  (bounded extra device memory), and each chunk is copied straight into the pinned buffer. The cast is
  the same IEEE rounding on either side, so the bytes are identical.
- gradients to the host: no copy back to the device in the backward, the global norm summed in one
  read (gradoffload.py); beside the fused step, no fp32 copy at all: cast on the host (hostgrads.py).
- overflow check: decided from the gradient norms stage 3 already takes (overflow.py).
- persistent parameters: kept gathered through the step, refreshed by one collective (persistent.py).
- gradients into the reduce bucket: the same copy with one stream lookup, not three (gradbucket.py), and
  a block's copies in one call (gradbatch.py).
- the gradient norm without optimizer offload: the small gradients' norms replayed from a CUDA graph
  (gradnorm.py).
- host threads: torchrun starts every rank with OMP_NUM_THREADS=1 unless told otherwise, and with
  `offload_optimizer` the whole optimizer step then runs on one core per rank. The step runs with
  cores/ranks OpenMP threads instead. Bit-identical only because of what runs there: DeepSpeedCPUAdam
  hands each OpenMP iteration whole SIMD blocks (the split between vector and scalar code does not move
  with the thread count), the unscale is one multiply per element, the overflow check is a yes/no.
  PyTorch's own CPU optimizers split ranges at thread-dependent boundaries, so they are left alone.
"""
from __future__ import annotations

import logging
import types
from typing import Any

import torch

from . import fusedstep, gradbatch, gradbucket, gradnorm, gradoffload, hostgrads, overflow, persistent, speedpaths
from .hostthreads import host_threads

log = logging.getLogger("z3guard")
CHUNK_NUMEL = 1 << 24  # 16M elements: 32 MiB of fp16 on the device at a time


def cast_copy_(dst: torch.Tensor, src: torch.Tensor, chunk_numel: int = CHUNK_NUMEL) -> None:
    """`dst.copy_(src)` for a cross-device, cross-dtype copy, without a host temporary."""
    if dst.device == src.device or dst.dtype == src.dtype:
        dst.copy_(src)
    else:
        chunked_cast_copy_(dst, src, chunk_numel)


def chunked_cast_copy_(dst: torch.Tensor, src: torch.Tensor, chunk_numel: int = CHUNK_NUMEL) -> None:
    """Cast each chunk where `src` lives, then copy it into `dst` (non-blocking into pinned memory)."""
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    non_blocking = dst.device.type == "cpu" and dst.is_pinned()
    for start in range(0, flat_src.numel(), chunk_numel):
        end = min(start + chunk_numel, flat_src.numel())
        flat_dst[start:end].copy_(flat_src[start:end].to(dst.dtype), non_blocking=non_blocking)
    if non_blocking and src.device.type == "cuda":
        torch.cuda.current_stream(src.device).synchronize()  # the host reads dst next


def apply(engine: Any, writeback: bool, overflow_check: bool, threads: int | None = 0,
          persistent_gather: bool = False, fused_step: bool = False, grad_offload: bool = False,
          grads_on_host: bool = True, grad_bucket: bool = False, grad_norm: bool = False,
          grad_batch: bool = False) -> list[str]:
    """Install the enabled fast paths on `engine`'s stage-3 optimizer; returns their names. None where
    something else already replaced one of the methods they replace on this instance (ZenFlow's
    overlapped step sets its own `step` and `partition_grads`): they follow stock's code, not that."""
    opt = engine.optimizer
    replaced = [name for name in PATCHED if name in vars(opt)]
    if replaced:
        log.info("z3guard: no offload fast paths on this engine: %s already replaced on its optimizer "
                 "(ZenFlow's overlapped step does that); DeepSpeed's own code runs", ", ".join(replaced))
        return []
    try:
        return _apply(opt, writeback, overflow_check, threads, persistent_gather, fused_step, grad_offload,
                      grads_on_host, grad_bucket, grad_norm, grad_batch)
    except BaseException:  # none or all: what was set before the failure goes again
        opt.z3guard_set_methods = [name for name in PATCHED if name in vars(opt)]
        remove(engine)
        raise


def _apply(opt: Any, writeback: bool, overflow_check: bool, threads: int | None, persistent_gather: bool,
           fused_step: bool, grad_offload: bool, grads_on_host: bool, grad_bucket: bool,
           grad_norm: bool, grad_batch: bool) -> list[str]:
    applied = []
    plain = _is_plain_stage3(opt)  # whose step's order of calls was checked (not SuperOffload's, ...)
    for name, wanted, path in (("grad_bucket", grad_bucket, gradbucket), ("grad_norm", grad_norm, gradnorm)):
        reason = path.why_off(opt) if wanted and plain else None
        if wanted and plain and reason is None:
            path.apply(opt)
            applied.append(name)
        elif reason is not None:
            speedpaths.say_off(name, reason)
    if grad_batch and "grad_bucket" in applied and hasattr(torch, "_foreach_copy_"):  # its add methods defer
        gradbatch.apply(opt)
        applied.insert(applied.index("grad_bucket") + 1, "grad_batch")
    if writeback and hasattr(opt, "fp16_partitioned_groups_flat"):
        opt._reassign_or_swap_out_partitioned_parameters = types.MethodType(_reassign_or_swap_out, opt)
        applied.append("writeback")
        if fused_step and plain and fusedstep.fusable(opt):  # it does the write-back's cast: only beside it
            fusedstep.apply(opt)
            applied.append("fused_step")
    if grad_offload and plain and gradoffload.applicable(opt):  # before the overflow check wraps it
        gradoffload.apply(opt)
        applied.append("grad_offload")
        if grads_on_host and "fused_step" in applied and hostgrads.applicable(opt):  # which reads the fp32 gradients' source
            hostgrads.apply(opt)
            applied.append("grads_cast_on_host")
    if overflow_check and hasattr(opt, "grad_partitions_flat_buffer"):
        overflow.apply(opt, trust_norms=plain)
        applied.append("overflow_check")
    if persistent_gather and plain and persistent.coalescable(list(opt.persistent_parameters)):
        persistent.apply(opt)
        applied.append("persistent_gather")
    n = host_threads(threads) if _host_optimizer_is_ds_cpu_adam(opt) else 0
    if n:
        from threadpoolctl import ThreadpoolController

        opt.z3guard_threads = (ThreadpoolController(), n)
        applied.append(f"host_threads={n}")
    if n or "fused_step" in applied or "persistent_gather" in applied:
        opt.z3guard_stock_step = opt.step
        opt.step = types.MethodType(_step, opt)
    opt.z3guard_set_methods = [name for name in PATCHED if name in vars(opt)]  # none was there before
    return applied


PATCHED = ("_reassign_or_swap_out_partitioned_parameters", "step", *gradbucket.PATCHED, *gradbatch.PATCHED,
           *gradnorm.PATCHED,
           *overflow.PATCHED, *persistent.PATCHED, *fusedstep.PATCHED, *gradoffload.PATCHED, *hostgrads.PATCHED)


def remove(engine: Any) -> None:
    """Drop the methods `apply` set on the optimizer instance (the class's come back) and every z3guard_
    note; what anything else set there stays."""
    opt = engine.optimizer
    hostgrads.materialise(opt)  # stock's code reads the fp32 gradients in memory
    gradbatch.flush_if_active(opt)  # no copy into the bucket left waiting
    ours = set(vars(opt).get("z3guard_set_methods", ()))
    for name in [n for n in vars(opt) if n in ours or n.startswith("z3guard_")]:
        del opt.__dict__[name]


def _host_optimizer_is_ds_cpu_adam(opt: Any) -> bool:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return bool(getattr(opt, "offload_optimizer", False)) and isinstance(getattr(opt, "optimizer", None),
                                                                          DeepSpeedCPUAdam)


def _is_plain_stage3(opt: Any) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return (type(opt) is DeepSpeedZeroOptimizer_Stage3 and hasattr(opt, "parameter_offload")
            and not getattr(opt, "zenflow", False))  # ZenFlow changes the step's calls from within


def _step(self, *args, **kwargs):
    """DeepSpeed's step, with the host threads (if set), and at its end nothing of the fused step left
    behind (what a step that raised half-way noted must not reach a later write-back) and persistent
    parameters it kept but did not refresh released (persistent.after_step)."""
    self.z3guard_in_step = True
    try:
        if getattr(self, "z3guard_threads", None) is None:
            return self.z3guard_stock_step(*args, **kwargs)
        controller, n = self.z3guard_threads
        with controller.limit(limits=n, user_api="openmp"):  # restored on exit
            return self.z3guard_stock_step(*args, **kwargs)
    finally:
        self.z3guard_in_step = False
        getattr(self, "z3guard_fused", {}).clear()
        persistent.after_step(self)


def _reassign_or_swap_out(self, sub_group_id: int) -> None:
    # DeepSpeed 0.19's `_reassign_or_swap_out_partitioned_parameters`, with the copy replaced.
    if self.fp16_partitioned_groups_flat[sub_group_id] is not None:
        if not fusedstep.take_written(self, sub_group_id):  # else the fused step cast it already
            cast_copy_(self.fp16_partitioned_groups_flat[sub_group_id].data,
                       self.fp32_partitioned_groups_flat[sub_group_id].data)
        self._unflatten_partitioned_parameters(sub_group_id)
    else:
        self._partitioned_params_swap_out(sub_group_id)
