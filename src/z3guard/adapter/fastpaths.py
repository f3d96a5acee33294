"""Faster, bit-identical replacements for two of ZeRO-3's CPU-offload hot paths (DeepSpeed 0.19).

- write-back: stage 3 copies each updated fp32 master partition into the fp16/bf16 flat buffer of the
  parameters with one `copy_`. With `offload_param` the destination is pinned host memory and the source
  sits on the GPU, and a cross-device, cross-dtype copy makes PyTorch allocate a pageable fp32 host
  temporary as large as the partition, every step. Here the cast runs on the device, chunk by chunk
  (bounded extra device memory), and each chunk is copied straight into the pinned buffer. The cast is
  the same IEEE rounding on either side, so the bytes are identical.
- overflow check: with `offload_optimizer` the fp16 overflow check runs `isinf(buf).any()` and
  `isnan(buf).any()` over the whole fp32 host gradient buffer, each making a full-size boolean
  temporary. Here one sum decides: a non-finite element makes the sum non-finite, so a finite sum proves
  there is none; only a non-finite sum (an overflow, or finite values summing past fp32's range) pays for
  the exact chunked check. Same decision, always.
"""
from __future__ import annotations

import types
from typing import Any

import torch

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


def any_nonfinite(t: torch.Tensor, chunk_numel: int = CHUNK_NUMEL) -> bool:
    """True iff `t` holds an inf or a NaN; exact, with no full-size temporary."""
    if torch.isfinite(t.sum()):
        return False
    flat = t.view(-1)
    return any(not torch.isfinite(flat[s:s + chunk_numel]).all() for s in range(0, flat.numel(), chunk_numel))


def apply(engine: Any, writeback: bool, overflow_check: bool) -> list[str]:
    """Install the enabled fast paths on `engine`'s stage-3 optimizer; returns their names."""
    opt = engine.optimizer
    applied = []
    if writeback and hasattr(opt, "fp16_partitioned_groups_flat"):
        opt._reassign_or_swap_out_partitioned_parameters = types.MethodType(_reassign_or_swap_out, opt)
        applied.append("writeback")
    if overflow_check and hasattr(opt, "grad_partitions_flat_buffer"):
        opt.z3guard_stock_has_overflow = opt.has_overflow
        opt.has_overflow = types.MethodType(_has_overflow, opt)
        applied.append("overflow_check")
    return applied


def remove(engine: Any) -> None:
    for name in ("_reassign_or_swap_out_partitioned_parameters", "has_overflow"):
        engine.optimizer.__dict__.pop(name, None)


def _reassign_or_swap_out(self, sub_group_id: int) -> None:
    # DeepSpeed 0.19's `_reassign_or_swap_out_partitioned_parameters`, with the copy replaced.
    if self.fp16_partitioned_groups_flat[sub_group_id] is not None:
        cast_copy_(self.fp16_partitioned_groups_flat[sub_group_id].data,
                   self.fp32_partitioned_groups_flat[sub_group_id].data)
        self._unflatten_partitioned_parameters(sub_group_id)
    else:
        self._partitioned_params_swap_out(sub_group_id)


def _has_overflow(self, partition_gradients: bool = True) -> bool:
    # DeepSpeed 0.19's `has_overflow` for partitioned gradients, with the inf/NaN test replaced.
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    buffer = self.grad_partitions_flat_buffer
    if not partition_gradients or buffer is None or buffer.device.type != "cpu":
        return self.z3guard_stock_has_overflow(partition_gradients)
    with get_accelerator().stream(self.reduce_and_partition_stream):
        if any_nonfinite(buffer):
            self.inf_or_nan_tracker.fill_(True)
        overflow_gpu = self.inf_or_nan_tracker.clone().to(get_accelerator().current_device_name()).to(torch.uint8)
        self.inf_or_nan_tracker.zero_()
    if not get_accelerator().resolves_data_dependency():
        get_accelerator().default_stream().wait_stream(self.reduce_and_partition_stream)
    dist.all_reduce(overflow_gpu, op=dist.ReduceOp.MAX, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=overflow_gpu, op=dist.ReduceOp.MAX)
    return bool(overflow_gpu[0].item())
