"""Fetching `offload_param` partitions without a host wait per parameter (DeepSpeed 0.19).

To gather a bucket of parameters, stage 3 copies each one's host partition to the device with a
blocking `.to(device)` inside the all-gather: one host synchronisation per parameter (~290 per forward
and as many per backward on GPT-2 medium), each also waiting for what the all-gather stream still runs
(the previous bucket's all-gather), so the host stops issuing the model's work while it waits. Here the
bucket's pinned partitions are first copied to the device without blocking, on that same stream, and
stock's gather runs on those copies (its `.to(device)` is then a no-op): the same bytes reach the same
collective in the same order; only the host no longer waits.

The copies read pinned host memory after the call returns, so host code that writes partitions waits
for the last of them first: the optimizer step (its write-back) and loading optimizer state.
"""
from __future__ import annotations

import types
from typing import Any

import torch

ALL_GATHER = "_PartitionedParameterCoordinator__all_gather_params_"  # set on the coordinator by apply
PATCHED = ("load_state_dict",)  # set on the optimizer by apply


def stageable(param: Any) -> bool:
    """A plain partition in pinned host memory, gathered from other ranks (with one rank, stock hands out
    the copy itself as the parameter): not swapped to NVMe, not quantized, no hpZ copy."""
    t = param.ds_tensor
    return (t is not None and t.device.type == "cpu" and getattr(param, "ds_zero_partition_world_size", 1) > 1 and getattr(param, "ds_secondary_tensor", None) is None
            and not hasattr(t, "ds_quant_scale") and getattr(t, "final_location", None) != "nvme"
            and t.is_pinned())


def apply(opt: Any, coordinator: Any) -> None:
    coordinator.z3guard_stock_all_gather = getattr(coordinator, ALL_GATHER)
    coordinator.z3guard_staged = None  # CUDA event after the last staged copies
    setattr(coordinator, ALL_GATHER, types.MethodType(_all_gather_params_, coordinator))
    opt.z3guard_coordinator = coordinator
    opt.z3guard_stock_load_state_dict = opt.load_state_dict
    opt.load_state_dict = types.MethodType(_load_state_dict, opt)


def remove(coordinator: Any) -> None:
    wait_for_copies(coordinator)
    for name in [n for n in vars(coordinator) if n == ALL_GATHER or n.startswith("z3guard_staged")
                 or n == "z3guard_stock_all_gather"]:
        del coordinator.__dict__[name]


def wait_for_copies(coordinator: Any) -> None:
    """Block until the staged copies have read their host partitions (before anything writes them)."""
    event = getattr(coordinator, "z3guard_staged", None)
    if event is not None:
        event.synchronize()
        coordinator.z3guard_staged = None


def stage_(params: list, stream: torch.cuda.Stream, device: torch.device) -> list[tuple[Any, torch.Tensor]]:
    """Point each parameter's partition at a device copy made on `stream` without blocking; returns the
    host tensors to point them back at. One device buffer per dtype, as large as the bucket's partitions
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
    return hosts


def _all_gather_params_(self, params: Any, forward: bool, quantize: bool = False) -> None:
    # DeepSpeed 0.19's, with the bucket's host partitions copied to the device first (see above).
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from deepspeed.accelerator import get_accelerator

    staged = [] if quantize else [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE and stageable(p)]
    if not staged:
        return self.z3guard_stock_all_gather(params, forward, quantize)
    stream = getattr(self, "_PartitionedParameterCoordinator__allgather_stream")
    hosts = stage_(staged, stream, torch.device(get_accelerator().current_device_name()))
    try:
        return self.z3guard_stock_all_gather(params, forward, quantize)
    finally:
        for p, host in hosts:
            p.ds_tensor.data = host
        event = torch.cuda.Event()
        event.record(stream)
        self.z3guard_staged = event


def _load_state_dict(self, *args, **kwargs):
    wait_for_copies(self.z3guard_coordinator)
    return self.z3guard_stock_load_state_dict(*args, **kwargs)
