"""The fp16 overflow check with `offload_optimizer` (DeepSpeed 0.19), without reading the gradients.

Stock runs `isinf(buf).any()` and `isnan(buf).any()` over the whole host gradient buffer on one thread,
each making a full-size boolean temporary (994 ms of a 2.5 s step on GPT-2 medium). But stage 3 has
already taken each parameter's gradient norm on the device when it copied that gradient into the buffer
(`_offload_grad_partition_at_boundary`), and a norm is finite exactly when its elements are: norms
accumulate in fp64 (fp32 on devices without it), and fp16 values cannot square past either's range (an
fp32 norm that did overflow makes stock skip the step anyway, at its own norm check). So a region
whose norm was noted as taken from what it holds now is decided from that norm; the rest are read:
a gradient left from an earlier step, a region written again since its norm (a micro-step of
accumulation), a norm replaced by `safe_set_local_grad`-style calls. The noted norm must be the very
object stage 3 holds, covering the whole region.

Reading, where it is still needed: with a pinned buffer and a GPU, chunks are copied to the device and
checked with `isfinite`; elsewhere one fp32 sum decides (a finite sum proves there is no inf/NaN), and
only a non-finite sum pays for the exact chunked check. The sum accumulates into fp32 chunk by chunk:
an fp16 sum of 177M gradients is past 65504 on every step (measured: the exact check then ran every
step, 176 ms).
"""
from __future__ import annotations

import types
from typing import Any

import torch

from .common import S3

CHUNK_NUMEL = 1 << 24  # 16M elements per chunk read
SUM_CHUNK_NUMEL = 1 << 22  # fp32 temporary of 16 MiB: under glibc's mmap ceiling, so reused, not faulted in


PATCHED = ("has_overflow", "_offload_grad_partition_at_boundary", "partition_grads")  # set by apply


def apply(opt: Any, trust_norms: bool) -> None:
    """Replace `has_overflow`; with `trust_norms`, note the norms stage 3 takes so the check can use them."""
    opt.z3guard_stock_has_overflow = opt.has_overflow
    opt.has_overflow = types.MethodType(_has_overflow, opt)
    if trust_norms and getattr(opt, "offload_optimizer", False):
        opt.z3guard_normed = {}  # ds_id -> (the norm tensor stage 3 stored, elements it covered)
        opt.z3guard_overflow_reads = {"checks": 0, "elements_read": 0}  # what the checks still read
        opt.z3guard_stock_offload_at_boundary = opt._offload_grad_partition_at_boundary
        opt._offload_grad_partition_at_boundary = types.MethodType(_offload_at_boundary, opt)
        opt.z3guard_stock_partition_grads = opt.partition_grads
        opt.partition_grads = types.MethodType(_partition_grads, opt)


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


def _sum_is_finite(t: torch.Tensor) -> bool:
    """fp16/bf16 are summed into fp32 chunk by chunk: one fp32 cast of the whole buffer would be a fresh
    full-size temporary (measured on GPT-2 medium: 130 ms of the step, mostly page faults)."""
    if t.dtype not in (torch.float16, torch.bfloat16):
        return bool(torch.isfinite(t.sum()))
    flat, total = t.view(-1), torch.zeros((), dtype=torch.float32)
    for start in range(0, flat.numel(), SUM_CHUNK_NUMEL):
        total += flat[start:start + SUM_CHUNK_NUMEL].sum(dtype=torch.float32)
    return bool(torch.isfinite(total))


def _has_overflow(self, partition_gradients: bool = True) -> bool:
    # DeepSpeed 0.19's `has_overflow` for partitioned gradients, with the inf/NaN test replaced.
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    buffer = self.grad_partitions_flat_buffer
    if not partition_gradients or buffer is None or buffer.device.type != "cpu":
        return self.z3guard_stock_has_overflow(partition_gradients)
    device = torch.device(get_accelerator().current_device_name())
    on = device if device.type != "cpu" and buffer.is_pinned() else None
    if device.type == "cuda":  # norms taken on the step's stream (unmanaged accumulation) are read below
        self.reduce_and_partition_stream.wait_stream(torch.cuda.current_stream(device))
    with get_accelerator().stream(self.reduce_and_partition_stream):
        if nonfinite_gradients(self, buffer, on):
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
    note_norm(self, param, grad_buffer.numel())


def note_norm(opt: Any, param: Any, numel: int) -> None:
    """Stage 3 just took `param`'s gradient norm over the `numel` elements now in its host region."""
    if (normed := getattr(opt, "z3guard_normed", None)) is not None:
        normed[param.ds_id] = (opt.norm_for_param_grads.get(opt.get_param_id(param)), numel)


def _partition_grads(self, params_to_release: list, grad_partitions: list):
    # DeepSpeed 0.19's, which writes these parameters' regions: their notes no longer hold (a boundary
    # micro-step notes them again as it takes their norms).
    for param in params_to_release:
        self.z3guard_normed.pop(param.ds_id, None)
    return self.z3guard_stock_partition_grads(params_to_release, grad_partitions)


def nonfinite_gradients(self, buffer: torch.Tensor, on: torch.device | None) -> bool:
    """Whether the host gradient buffer holds an inf/NaN: from the norms where they cover a region, else
    read (see the module's docstring)."""
    regions = getattr(self, S3 + "param_id_to_grad_partition", None)
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
