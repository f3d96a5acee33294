"""Faster, bit-identical replacements for ZeRO-3's CPU-offload hot paths (DeepSpeed 0.19; fusedstep.py has one more).

- write-back: stage 3 copies each updated fp32 master partition into the fp16/bf16 flat buffer of the
  parameters with one `copy_`. With `offload_param` the destination is pinned host memory and the source
  sits on the GPU, and a cross-device, cross-dtype copy makes PyTorch allocate a pageable fp32 host
  temporary as large as the partition, every step. Here the cast runs on the device, chunk by chunk
  (bounded extra device memory), and each chunk is copied straight into the pinned buffer. The cast is
  the same IEEE rounding on either side, so the bytes are identical.
- overflow check: with `offload_optimizer` the fp16 overflow check runs `isinf(buf).any()` and
  `isnan(buf).any()` over the whole host gradient buffer on one thread, each making a full-size boolean
  temporary. But stage 3 has already taken each parameter's gradient norm on the device when it copied
  that gradient into the buffer, and a norm is finite exactly when its elements are (fp16 values can't
  square past fp32's range; an fp32 norm that did overflow makes stock skip the step anyway, at its
  norm check). So regions whose norm was taken from what they hold now are decided from their norms;
  the rest (a gradient left from an earlier step, a norm replaced since) are read. Reading: where the
  buffer is pinned and there is a GPU, chunks are copied there and checked with `isfinite`; elsewhere
  one sum decides: a finite sum proves there is no inf/NaN; only a non-finite sum (an overflow, or
  finite values summing past fp32's range) pays for the exact chunked check. The sum accumulates into
  fp32, chunk by chunk: the buffer is fp16 under fp16 training, and an fp16 sum of 177M gradients is
  past 65504 on every step (measured: the exact check then ran every step, 176 ms).
- persistent gather: at each step's start stage 3 releases every parameter, the persistent ones
  (biases, norms: 194 on GPT-2 medium) included, one by one; after an applied step it gathers those
  again with one collective per parameter. Here the persistent parameters stay gathered through the
  step (the step changes only their partitions; a skipped step changes nothing), and after an applied
  step one all-gather of their concatenated partitions refreshes them in place, in DeepSpeed's
  rank-major layout. Outside `step` (checkpointing, `empty_partition_cache`) everything is released
  as in stock.
- host threads: torchrun starts every rank with OMP_NUM_THREADS=1 unless told otherwise, and with
  `offload_optimizer` the whole optimizer step then runs on one core per rank. The step runs with
  cores/ranks OpenMP threads instead. Bit-identical only because of what runs there: DeepSpeedCPUAdam
  hands each OpenMP iteration whole SIMD blocks (the split between vector and scalar code does not move
  with the thread count), the unscale is one multiply per element, the overflow check is a yes/no.
  PyTorch's own CPU optimizers split ranges at thread-dependent boundaries, so they are left alone.
"""
from __future__ import annotations

import types
from typing import Any

import torch

from . import fusedstep
from .hostthreads import host_threads

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


def any_nonfinite(t: torch.Tensor, chunk_numel: int = CHUNK_NUMEL, on: torch.device | None = None) -> bool:
    """True iff `t` holds an inf or a NaN; exact, with no full-size temporary. `on`: a device to check
    the chunks on (copied there from `t`, which should then be pinned)."""
    if on is not None:
        return _any_nonfinite_on(on, t, chunk_numel)
    if _sum_is_finite(t):
        return False
    flat = t.view(-1)
    return any(not torch.isfinite(flat[s:s + chunk_numel]).all() for s in range(0, flat.numel(), chunk_numel))


def _any_nonfinite_on(device: torch.device, t: torch.Tensor, chunk_numel: int) -> bool:
    flat, found = t.view(-1), torch.zeros((), dtype=torch.bool, device=device)
    for start in range(0, flat.numel(), chunk_numel):
        chunk = flat[start:start + chunk_numel].to(device, non_blocking=True)
        found |= ~torch.isfinite(chunk).all()
    return bool(found)  # waits for the copies: `t` is not read after this returns


SUM_CHUNK_NUMEL = 1 << 22  # fp32 temporary of 16 MiB: under glibc's mmap ceiling, so reused, not faulted in


def _sum_is_finite(t: torch.Tensor) -> bool:
    """fp16/bf16 are summed into fp32 chunk by chunk: one fp32 cast of the whole buffer would be a fresh
    full-size temporary (measured on GPT-2 medium: 130 ms of the step, mostly page faults)."""
    if t.dtype not in (torch.float16, torch.bfloat16):
        return bool(torch.isfinite(t.sum()))
    flat, total = t.view(-1), torch.zeros((), dtype=torch.float32)
    for start in range(0, flat.numel(), SUM_CHUNK_NUMEL):
        total += flat[start:start + SUM_CHUNK_NUMEL].sum(dtype=torch.float32)
    return bool(torch.isfinite(total))


def coalesced_gather_(params: list, device: torch.device) -> None:
    """Gather parameters of one process group from their partitions with one collective; same bytes,
    same layout (rank 0's partition, rank 1's, ..., cut to its size) as stock's. A parameter that is
    gathered already is refreshed in place."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    group = params[0].ds_process_group
    world = dist.get_world_size(group=group)
    sizes = [p.ds_tensor.ds_numel for p in params]
    local = torch.cat([p.ds_tensor.view(-1) for p in params]).to(device)
    gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    by_rank, offset = gathered.view(world, -1), 0
    for p, n in zip(params, sizes):
        if p.ds_status == ZeroParamStatus.AVAILABLE and p.data.shape == p.ds_shape:
            p.data.view(-1).copy_(by_rank[:, offset:offset + n].reshape(-1)[:p.ds_numel])
        else:
            p.data = by_rank[:, offset:offset + n].reshape(-1).narrow(0, 0, p.ds_numel).view(p.ds_shape)
            p.ds_status = ZeroParamStatus.AVAILABLE
        offset += n


def _coalescable(params: list) -> bool:
    """Plain partitioned parameters only: one process group and dtype, partitions in memory (not swapped
    to NVMe, which DeepSpeed's gather swaps in first), no quantized or secondary (hpZ) partitions;
    anything else keeps DeepSpeed's own gather."""
    from deepspeed import comm as dist

    first = params[0] if params else None
    return (len(params) > 1 and dist.has_all_gather_into_tensor()
            and all(p.ds_process_group is first.ds_process_group and p.ds_tensor.dtype == first.ds_tensor.dtype
                    and getattr(p.ds_tensor, "final_location", None) != "nvme"
                    and not hasattr(p.ds_tensor, "ds_quant_scale") and getattr(p, "ds_secondary_tensor", None) is None
                    for p in params))


def apply(engine: Any, writeback: bool, overflow_check: bool, threads: int | None = 0,
          persistent_gather: bool = False, fused_step: bool = False) -> list[str]:
    """Install the enabled fast paths on `engine`'s stage-3 optimizer; returns their names."""
    opt = engine.optimizer
    applied = []
    if writeback and hasattr(opt, "fp16_partitioned_groups_flat"):
        opt._reassign_or_swap_out_partitioned_parameters = types.MethodType(_reassign_or_swap_out, opt)
        applied.append("writeback")
        if fused_step and fusedstep.fusable(opt):  # it does the write-back's cast: only beside it
            fusedstep.apply(opt)
            applied.append("fused_step")
    if overflow_check and hasattr(opt, "grad_partitions_flat_buffer"):
        opt.z3guard_stock_has_overflow = opt.has_overflow
        opt.has_overflow = types.MethodType(_has_overflow, opt)
        if getattr(opt, "offload_optimizer", False) and hasattr(opt, "_offload_grad_partition_at_boundary"):
            opt.z3guard_normed = {}  # ds_id -> (the norm tensor stage 3 stored, elements it covered)
            opt.z3guard_overflow_reads = {"checks": 0, "elements_read": 0}  # what the checks still read
            opt.z3guard_stock_offload_at_boundary = opt._offload_grad_partition_at_boundary
            opt._offload_grad_partition_at_boundary = types.MethodType(_offload_at_boundary, opt)
        applied.append("overflow_check")
    if persistent_gather and _coalescable(list(getattr(opt, "persistent_parameters", []))):
        opt._post_step = types.MethodType(_post_step, opt)
        if _is_plain_stage3(opt):  # its step is the one whose order of calls was checked
            opt.z3guard_stock_partition_all = opt._partition_all_parameters
            opt._partition_all_parameters = types.MethodType(_partition_all_parameters, opt)
        applied.append("persistent_gather")
    n = host_threads(threads) if _host_optimizer_is_ds_cpu_adam(opt) else 0
    if n:
        from threadpoolctl import ThreadpoolController

        opt.z3guard_threads = (ThreadpoolController(), n)
        applied.append(f"host_threads={n}")
    if n or "fused_step" in applied or "persistent_gather" in applied:
        opt.z3guard_stock_step = opt.step
        opt.step = types.MethodType(_step, opt)
    return applied


PATCHED = ("_reassign_or_swap_out_partitioned_parameters", "has_overflow", "step", "_post_step",
           "_partition_all_parameters", "_offload_grad_partition_at_boundary")


def remove(engine: Any) -> None:
    """Drop every method set on the optimizer instance (the class's come back) and every z3guard_ note."""
    opt = engine.optimizer
    for name in [n for n in vars(opt) if n in PATCHED or n.startswith("z3guard_")]:
        del opt.__dict__[name]
    fusedstep.remove(engine.optimizer)


def _host_optimizer_is_ds_cpu_adam(opt: Any) -> bool:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return bool(getattr(opt, "offload_optimizer", False)) and isinstance(getattr(opt, "optimizer", None),
                                                                          DeepSpeedCPUAdam)


def _is_plain_stage3(opt: Any) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return type(opt) is DeepSpeedZeroOptimizer_Stage3 and hasattr(opt, "parameter_offload")


def _step(self, *args, **kwargs):
    """DeepSpeed's step, with the host threads (if set) and nothing of the fused step left behind
    (what a step that raised half-way noted must not reach a later write-back)."""
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


def _reassign_or_swap_out(self, sub_group_id: int) -> None:
    # DeepSpeed 0.19's `_reassign_or_swap_out_partitioned_parameters`, with the copy replaced.
    if self.fp16_partitioned_groups_flat[sub_group_id] is not None:
        if not fusedstep.take_written(self, sub_group_id):  # else the fused step cast it already
            cast_copy_(self.fp16_partitioned_groups_flat[sub_group_id].data,
                       self.fp32_partitioned_groups_flat[sub_group_id].data)
        self._unflatten_partitioned_parameters(sub_group_id)
    else:
        self._partitioned_params_swap_out(sub_group_id)


def _partition_all_parameters(self) -> None:
    # DeepSpeed 0.19's, but inside `step` the persistent parameters that are gathered stay so.
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    if not getattr(self, "z3guard_in_step", False):
        return self.z3guard_stock_partition_all()
    offload = self.parameter_offload
    coordinator = offload.get_param_coordinator()
    inflight = getattr(coordinator, "_PartitionedParameterCoordinator__inflight_param_registry")
    release = getattr(coordinator, "_PartitionedParameterCoordinator__release_param")
    kept = 0
    for param in iter_params(offload.module, recurse=True):
        if param in inflight:
            inflight.pop(param).wait()
        param.ds_active_sub_modules.clear()
        if param.ds_persist and param.ds_status == ZeroParamStatus.AVAILABLE:
            kept += 1
        else:
            release(param)
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                raise RuntimeError(f"{param.ds_summary()} expected to be released")
    self.z3guard_kept_gathered = kept  # persistent parameters this step did not release


def _post_step(self, timer_names) -> None:
    # DeepSpeed 0.19's `_post_step`, with the persistent parameters gathered (or refreshed, where they
    # stayed gathered through the step) by one collective.
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if self.offload_optimizer:
        self.reset_cpu_buffers()
    partitioned = [p for p in self.persistent_parameters if p.ds_status != ZeroParamStatus.INFLIGHT]
    if _coalescable(partitioned):
        from deepspeed.accelerator import get_accelerator

        coalesced_gather_(partitioned, torch.device(get_accelerator().current_device_name()))
    elif self.persistent_parameters:
        for param in [p for p in self.persistent_parameters if p.ds_status == ZeroParamStatus.AVAILABLE]:
            param.partition()  # kept through the step, stale now: DeepSpeed's gather skips gathered ones
        self.persistent_parameters[0].all_gather(self.persistent_parameters)
    if self.swap_optimizer:
        self.optimizer_swapper.log_timers()
    self.invalidate_secondary_tensor()
    self.timers.log(timer_names)


def _has_overflow(self, partition_gradients: bool = True) -> bool:
    # DeepSpeed 0.19's `has_overflow` for partitioned gradients, with the inf/NaN test replaced.
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    buffer = self.grad_partitions_flat_buffer
    if not partition_gradients or buffer is None or buffer.device.type != "cpu":
        return self.z3guard_stock_has_overflow(partition_gradients)
    device = torch.device(get_accelerator().current_device_name())
    on = device if device.type != "cpu" and buffer.is_pinned() else None
    with get_accelerator().stream(self.reduce_and_partition_stream):
        if _nonfinite_gradients(self, buffer, on):
            self.inf_or_nan_tracker.fill_(True)
        overflow_gpu = self.inf_or_nan_tracker.clone().to(get_accelerator().current_device_name()).to(torch.uint8)
        self.inf_or_nan_tracker.zero_()
    if not get_accelerator().resolves_data_dependency():
        get_accelerator().default_stream().wait_stream(self.reduce_and_partition_stream)
    dist.all_reduce(overflow_gpu, op=dist.ReduceOp.MAX, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=overflow_gpu, op=dist.ReduceOp.MAX)
    return bool(overflow_gpu[0].item())


def _offload_at_boundary(self, param, grad_buffer, *args) -> None:
    # DeepSpeed 0.19's: takes the gradient's norm from `grad_buffer` (what the host region holds) and
    # copies it on to the fp32 gradients. Noted: which norm object covers which region, and how much of it.
    self.z3guard_stock_offload_at_boundary(param, grad_buffer, *args)
    self.z3guard_normed[param.ds_id] = (self.norm_for_param_grads.get(self.get_param_id(param)), grad_buffer.numel())


def _nonfinite_gradients(self, buffer: torch.Tensor, on: torch.device | None) -> bool:
    """Whether the host gradient buffer holds an inf/NaN: from the norms where they cover a region, else
    read (see the module's docstring)."""
    regions = getattr(self, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None)
    normed = getattr(self, "z3guard_normed", None)
    if regions is None or normed is None:
        return any_nonfinite(buffer, on=on)
    norms, unread, seen = [], [], 0
    for group in self.fp16_groups:
        for param in group:
            region = regions[param.ds_id]
            seen += region.numel()
            norm = self.norm_for_param_grads.get(self.get_param_id(param))
            noted = normed.get(param.ds_id)
            if norm is not None and noted is not None and noted[0] is norm and noted[1] == region.numel():
                norms.append(norm)
            else:
                unread.append(region)
    reads = self.z3guard_overflow_reads
    reads["checks"] += 1
    if seen != buffer.numel():  # the regions are not the whole buffer as in 0.19: read it all
        reads["elements_read"] += buffer.numel()
        return any_nonfinite(buffer, on=on)
    if norms and not bool(torch.isfinite(torch.stack([n.reshape(()) for n in norms])).all()):
        return True
    reads["elements_read"] += sum(region.numel() for region in unread)
    return any(any_nonfinite(region, on=on) for region in unread if region.numel())
