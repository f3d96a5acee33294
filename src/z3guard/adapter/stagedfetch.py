"""Fetching `offload_param` partitions with one host wait per bucket, not one per parameter (DeepSpeed 0.19).

To gather a bucket of parameters, stage 3 copies each one's host partition to the device with a
blocking `.to(device)` inside the all-gather: one host synchronisation per parameter (~290 per forward
and as many per backward on GPT-2 medium), each also waiting for what the all-gather stream still runs.
Here the bucket's pinned partitions are copied to the device first, without blocking, on that same
stream, then the host waits once for them, and stock's gather runs on those copies (its `.to(device)`
is then a no-op): the same bytes reach the same collective in the same order.

Only buckets that stock gathers coalesced are staged (two or more parameters of one process group, no
`stage3_allgather_sequential`): there the copies are read by a `torch.cat` on the same stream, before
they are freed. A lone parameter goes to the collective itself, as the very tensor object `.to` returned,
which here is the partition whose storage is pointed back at the host on return: the device copy was
then freed while NCCL could still read it (GPU results differed at a random step, b19 and b21).
The one host wait per bucket keeps every later host write to the partitions safe without more hooks.
"""
from __future__ import annotations

import types
from typing import Any

import torch

ALL_GATHER = "_PartitionedParameterCoordinator__all_gather_params_"  # set on the coordinator by apply
PATCHED: tuple[str, ...] = ()  # nothing is set on the optimizer


def stageable(param: Any) -> bool:
    """A plain partition in pinned host memory, gathered from other ranks (with one rank, stock hands out
    the copy itself as the parameter): not swapped to NVMe, not quantized, no hpZ copy."""
    t = param.ds_tensor
    return (t is not None and t.device.type == "cpu" and getattr(param, "ds_zero_partition_world_size", 1) > 1
            and getattr(param, "ds_secondary_tensor", None) is None and not hasattr(t, "ds_quant_scale")
            and getattr(t, "final_location", None) != "nvme" and t.is_pinned())


def coalesced(params: list) -> bool:
    """Whether stock gathers these with one coalesced collective that reads the copies through a
    `torch.cat` (see above), all of them stageable."""
    return (len(params) > 1 and all(stageable(p) for p in params)
            and all(p.ds_process_group is params[0].ds_process_group for p in params))


def apply(coordinator: Any) -> None:
    coordinator.z3guard_stock_all_gather = getattr(coordinator, ALL_GATHER)
    setattr(coordinator, ALL_GATHER, types.MethodType(_all_gather_params_, coordinator))


def remove(coordinator: Any) -> None:
    for name in (ALL_GATHER, "z3guard_stock_all_gather"):
        coordinator.__dict__.pop(name, None)


def stage_(params: list, stream: torch.cuda.Stream, device: torch.device) -> list[tuple[Any, torch.Tensor]]:
    """Point each parameter's partition at a device copy made on `stream`, waiting once for all of them;
    returns (parameter, host tensor) pairs to point them back at. One device buffer per dtype, as large as the bucket's partitions
    (what stock's per-parameter `.to(device)` allocates, too)."""
    by_dtype: dict[torch.dtype, list] = {}
    for p in params:
        by_dtype.setdefault(p.ds_tensor.dtype, []).append(p)
    hosts = []
    with torch.cuda.stream(stream):
        for dtype, group in by_dtype.items():
            buffer = torch.empty(sum(p.ds_tensor.numel() for p in group), dtype=dtype, device=device)
            offset = 0
            for p in group:
                host = p.ds_tensor.data
                copy = buffer.narrow(0, offset, host.numel()).view(host.shape)
                copy.copy_(host, non_blocking=True)
                hosts.append((p, host))
                p.ds_tensor.data = copy
                offset += host.numel()
        stream.synchronize()  # the host partitions are read: anything may write them again
    return hosts


def _all_gather_params_(self, params: Any, forward: bool, quantize: bool = False) -> None:
    # DeepSpeed 0.19's, with the bucket's host partitions copied to the device first (see above).
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from deepspeed.accelerator import get_accelerator

    staged = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if quantize or not coalesced(staged):
        return self.z3guard_stock_all_gather(params, forward, quantize)
    stream = getattr(self, "_PartitionedParameterCoordinator__allgather_stream")
    hosts = stage_(staged, stream, torch.device(get_accelerator().current_device_name()))
    try:
        return self.z3guard_stock_all_gather(params, forward, quantize)
    finally:
        for p, host in hosts:
            p.ds_tensor.data = host
