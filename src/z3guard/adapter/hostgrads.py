"""fp32 gradients on the host, kept as the fp16/bf16 copy they are cast from until something reads them
(DeepSpeed 0.19, `offload_optimizer` with the fused step).

At a boundary's first micro-step stage 3's backward copies each gradient partition into its host region
(fp16 on GPT-2 medium) and then, cast to fp32 on the device, a second time into the fp32 gradient the
optimizer reads: twice the first copy's bytes again over the bus, waited for at the end of the
backward (on 2 H200s ~9 ms of the backward's ~40 ms gradient offload; docs/benchmarks.md,
"Where the time goes").
The cast is exact (every fp16/bf16 value is an fp32 value), so the fp32 gradient is a function of the
region: here it is noted as `Lazy` and computed where it is read. The fused step casts each chunk
from the region into a cache-sized scratch, unscales it there and hands it to Adam, so neither the copy
over the bus nor the fp32 gradient's write and re-read in host memory happens. Afterwards the gradient is
still "the region, cast, times the step's factor", as stock's in-place unscale leaves it.

Anything else that reads or writes the fp32 gradients first makes the noted ones real: DeepSpeed's
accessors (`safe_get_full_grad`, `safe_set_full_grad`, ...; all of them go through the methods in
MATERIALISED_BEFORE, `test_every_reader_of_the_fp32_gradients_is_known` checks that against DeepSpeed's
source), stock's unscale and optimizer step where the fused step stands aside, stock's `partition_grads`
before it writes a noted region again, and `fastpaths.remove`; `destroy` drops them.

Not bit for bit: the payload of a NaN (a skipped step's gradients, read through an accessor) is the host
cast's rather than the GPU's; NaN stays NaN.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Lazy:
    """One parameter's fp32 gradient: `source` (its host region) cast, times `scaled_by` if not None."""

    dest: int  # offset in the sub-group's flat fp32 gradient
    source: torch.Tensor
    scaled_by: Any = None  # the unscale factor of the step that used it (stock's in-place `grad.mul_`)

    def write(self, grad: torch.Tensor) -> None:
        target = grad.narrow(0, self.dest, self.source.numel())
        target.copy_(self.source)
        if self.scaled_by is not None:
            target.mul_(self.scaled_by)


@dataclass
class Run:
    """Entries next to each other both in the fp32 gradient and in host memory: one slice each."""

    start: int
    end: int
    source: torch.Tensor  # flat, end - start elements


MATERIALISED_BEFORE = ("_get_fp32_grad_state_partition", "get_fp32_grad_partitions",
                       "update_fp32_grad_for_param_vectorized", "finalize_gradient_accumulation_boundary")
DROPPED_BEFORE = ("_unpin_offload_buffers",)  # at destroy, which frees the buffers the notes point into
PATCHED = MATERIALISED_BEFORE + DROPPED_BEFORE


def applicable(opt: Any) -> bool:
    """Every sub-group's fp32 gradient in host memory, where the fused step reads it."""
    return all(flat.grad is not None and flat.grad.device.type == "cpu" for flat in opt.fp32_partitioned_groups_flat)


def apply(opt: Any) -> None:
    opt.z3guard_lazy = {}  # sub-group -> {param ds_id: Lazy}
    opt.z3guard_lazy_written = {"for_readers": 0, "stale": 0}  # notes made real, and why
    for names, before in ((MATERIALISED_BEFORE, materialise), (DROPPED_BEFORE, _forgetting)):
        for name in names:
            setattr(opt, name, types.MethodType(_first(before, getattr(opt, name)), opt))


def _first(before: Callable, stock: Callable) -> Callable:
    def method(self, *args, **kwargs):
        before(self)
        return stock(*args, **kwargs)
    return method


def _forgetting(opt: Any) -> None:
    """Nothing reads the gradients after `destroy` (whose buffers DS_PIN_MEMORY_BACKEND=native frees)."""
    opt.z3guard_lazy.clear()


def defer(opt: Any, param: Any, region: torch.Tensor) -> None:
    """The backward copied `param`'s gradient into `region`: its fp32 gradient is that, cast."""
    i, dest, _ = opt.grad_position[opt.get_param_id(param)]
    opt.z3guard_lazy.setdefault(i, {})[param.ds_id] = Lazy(dest, region.view(-1))


def materialise(opt: Any, sub_group: int | None = None, params: list | None = None) -> None:
    """Write the noted fp32 gradients (of one sub-group, or of `params`, or all) into host memory."""
    lazy = getattr(opt, "z3guard_lazy", None) or {}
    if not any(lazy.values()):  # nothing noted (or hostgrads not applied): no per-parameter lookups
        return
    if params is not None:
        due = [(i, p.ds_id) for p in params
               if p.ds_id in lazy.get(i := opt.grad_position[opt.get_param_id(p)][0], {})]
    else:
        due = [(i, d) for i in ([sub_group] if sub_group is not None else list(lazy)) for d in lazy.get(i, {})]
    if not due:
        return
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().resolves_data_dependency():  # the regions' copies may still be in flight
        opt.reduce_and_partition_stream.synchronize()
    for i, ds_id in due:
        lazy[i].pop(ds_id).write(opt.fp32_partitioned_groups_flat[i].grad.view(-1))
        opt.z3guard_lazy_written["for_readers"] += 1


def runs_for_step(opt: Any, sub_group: int) -> list[Run]:
    """What the fused step reads from the regions: the entries this backward noted. Ones a step already
    used (a parameter without a gradient since) are written to memory first, where the step's unscale
    multiplies them again as stock's does."""
    entries = getattr(opt, "z3guard_lazy", {}).get(sub_group, {})
    stale = [p for p, e in entries.items() if e.scaled_by is not None]
    for ds_id in stale:
        entries.pop(ds_id).write(opt.fp32_partitioned_groups_flat[sub_group].grad.view(-1))
        opt.z3guard_lazy_written["stale"] += 1
    runs: list[Run] = []
    for e in sorted(entries.values(), key=lambda e: e.dest):
        last = runs[-1] if runs else None
        if (last is not None and last.end == e.dest and last.source.dtype == e.source.dtype
                and last.source.untyped_storage().data_ptr() == e.source.untyped_storage().data_ptr()
                and last.source.storage_offset() + last.source.numel() == e.source.storage_offset()):
            n = last.end - last.start + e.source.numel()
            runs[-1] = Run(last.start, last.start + n, torch.as_strided(last.source, (n,), (1,),
                                                                         last.source.storage_offset()))
        else:
            runs.append(Run(e.dest, e.dest + e.source.numel(), e.source))
    return runs


def stepped(opt: Any, sub_group: int, factor: Any) -> None:
    """The step unscaled the noted gradients by `factor` (in the scratch, not in memory)."""
    for e in getattr(opt, "z3guard_lazy", {}).get(sub_group, {}).values():
        e.scaled_by = factor
