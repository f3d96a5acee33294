"""Persistent parameters (biases, norms: 194 on GPT-2 medium) across the optimizer step (DeepSpeed 0.19).

At each step's start stage 3 releases every parameter, the persistent ones included, one by one; after
an applied step it gathers those again with one collective per parameter. Here the persistent parameters
stay gathered through the step (the step changes only their partitions), and after an applied step one
all-gather of their concatenated partitions refreshes them in place, in DeepSpeed's rank-major layout.
A step that ends without that refresh (skipped for an overflow, or raised) releases them at its end,
which is where stock leaves them: the next forward fetches them as stock's does. Only parameters that
own their storage are kept (a fetch by all-reduce leaves views into a shared buffer, which keeping would
hold). Outside `step` (checkpointing, `empty_partition_cache`) everything is released as in stock.
"""
from __future__ import annotations

import types
from typing import Any

import torch

from .common import P
from .coordinator import release_of


PATCHED = ("_post_step", "_partition_all_parameters")  # set by apply


def apply(opt: Any) -> None:
    """On plain stage 3 (whose step's order of calls this follows); `step` must set `z3guard_in_step` and
    call `after_step` at its end (fastpaths._step)."""
    opt._post_step = types.MethodType(_post_step, opt)
    opt.z3guard_stock_partition_all = opt._partition_all_parameters
    opt._partition_all_parameters = types.MethodType(_partition_all_parameters, opt)


def coalescable(params: list) -> bool:
    """Plain partitioned parameters only: one process group and dtype, partitions in memory (not swapped
    to NVMe, which DeepSpeed's gather swaps in first), no quantized or secondary (hpZ) partitions, no
    communication dtype of their own (torch autocast); anything else keeps DeepSpeed's own gather."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.partition_parameters import has_comm_dtype

    first = params[0] if params else None
    return (len(params) > 1 and dist.has_all_gather_into_tensor()
            and all(p.ds_process_group is first.ds_process_group and p.ds_tensor.dtype == first.ds_tensor.dtype
                    and getattr(p.ds_tensor, "final_location", None) != "nvme"
                    and not hasattr(p.ds_tensor, "ds_quant_scale") and getattr(p, "ds_secondary_tensor", None) is None
                    and not has_comm_dtype(p) for p in params))


def coalesced_gather_(params: list, device: torch.device) -> None:
    """Gather parameters of one process group from their partitions with one collective; same bytes,
    same layout (rank 0's partition, rank 1's, ..., cut to its size) as stock's. A parameter that is
    gathered already is refreshed in place; one that is not gets storage of its own."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    group = params[0].ds_process_group
    world = dist.get_world_size(group=group)
    sizes = [p.ds_tensor.ds_numel for p in params]
    local = torch.cat([p.ds_tensor.view(-1) for p in params]).to(device)
    gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    by_rank, offset = gathered.view(world, -1), 0
    refreshed, sources = [], []  # whose rank-major parts tile them: copied in one call below
    for p, n in zip(params, sizes):
        if p.ds_status != ZeroParamStatus.AVAILABLE or p.data.shape != p.ds_shape:
            # storage of its own, not a view into `gathered`: the next step then keeps it gathered
            # (`_owns_storage`), where a view would be released and gathered again at every step
            p.data = torch.empty(p.ds_shape, dtype=local.dtype, device=device)
            p.ds_status = ZeroParamStatus.AVAILABLE
        if p.ds_numel == world * n and p.data.is_contiguous():
            refreshed.append(p.data.view(world, n))
            sources.append(by_rank[:, offset:offset + n])
        else:
            p.data.view(-1).copy_(by_rank[:, offset:offset + n].reshape(-1)[:p.ds_numel])
        offset += n
    if refreshed and hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(refreshed, sources)
    else:  # nothing to refresh, or a torch without `_foreach_copy_`
        for dst, src in zip(refreshed, sources):
            dst.copy_(src)


def after_step(opt: Any) -> None:
    """Where the step kept persistent parameters but did not refresh them: release them, as stock left them."""
    if not getattr(opt, "z3guard_refreshed", True):
        _release_gathered(opt.persistent_parameters)
        opt.z3guard_refreshed = True


def _release_gathered(params: list) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for param in params:
        if param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_active_sub_modules:
            param.partition()


def _owns_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _partition_all_parameters(self) -> None:
    # DeepSpeed 0.19's, but inside `step` the persistent parameters that are gathered stay so.
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    if not getattr(self, "z3guard_in_step", False):
        return self.z3guard_stock_partition_all()
    offload = self.parameter_offload
    coordinator = offload.get_param_coordinator()
    inflight = getattr(coordinator, P + "inflight_param_registry")
    release = release_of(coordinator)
    kept = 0
    for param in iter_params(offload.module, recurse=True):
        if param in inflight:
            inflight.pop(param).wait()
        param.ds_active_sub_modules.clear()
        if param.ds_persist and param.ds_status == ZeroParamStatus.AVAILABLE and _owns_storage(param.data):
            kept += 1
        else:
            release(param)
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                raise RuntimeError(f"{param.ds_summary()} expected to be released")
    self.z3guard_kept_gathered, self.z3guard_refreshed = kept, kept == 0


def _post_step(self, timer_names) -> None:
    # DeepSpeed 0.19's `_post_step`, with the persistent parameters gathered (or refreshed, where they
    # stayed gathered through the step) by one collective.
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if self.offload_optimizer:
        self.reset_cpu_buffers()
    params = [p for p in self.persistent_parameters if p.ds_status != ZeroParamStatus.INFLIGHT]
    if coalescable(params):
        from deepspeed.accelerator import get_accelerator

        coalesced_gather_(params, torch.device(get_accelerator().current_device_name()))
    elif self.persistent_parameters:
        _release_gathered(self.persistent_parameters)  # kept, stale now: DeepSpeed's gather skips gathered ones
        self.persistent_parameters[0].all_gather(self.persistent_parameters)
    self.z3guard_refreshed = True
    if self.swap_optimizer:
        self.optimizer_swapper.log_timers()
    self.invalidate_secondary_tensor()
    self.timers.log(timer_names)
