"""One pass instead of three over the host optimizer state (DeepSpeed 0.19, `offload_optimizer` with
DeepSpeedCPUAdam).

Stock stage 3 runs, per sub-group, three passes over the whole fp32 partition on the host: the unscale
(`grad.mul_`), the Adam step, and the write-back cast into the fp16/bf16 partition. Each pass streams
hundreds of MB through memory (GPT-2 medium: 177M elements per rank). Here the three run on one
cache-sized chunk after another, so the unscale's output and Adam's updated parameters are read back from
cache. What remains is bound by the host's memory bandwidth, which the ranks share (docs/benchmarks.md,
"Optimizer step" and "What did not help").

Bit-identical: the unscale and the cast are elementwise; Adam is elementwise too, and its AVX kernel
rounds each call's range down to a block of SIMD_WIDTH x 8 elements, running the tail through narrower
code. Chunks are a multiple of that block (DeepSpeed's own ZenFlow slices the same way for the same
reason), so every element takes the same code path as in the whole-partition call; the step count is
passed unchanged to every chunk, which the kernel treats as "already incremented".

The three stock methods stay the units DeepSpeed calls: the unscale only records its factor, the
optimizer step runs the chunks, the write-back only unflattens what the chunks wrote. Where something
expects DeepSpeedCPUAdam.step itself to run (step hooks, an LR scheduler counting its calls), the step
stays stock's; its profiler label is the one thing the fused step does not keep.
"""
from __future__ import annotations

import itertools
import types
from typing import Any, Sequence

import torch

from . import hostgrads

CHUNK_NUMEL = 1 << 20  # 4 MiB of fp32 per tensor; a multiple of every SIMD_WIDTH x 8 (at most 128)


def fusable(opt: Any) -> bool:
    """On plain stage 3 (fastpaths._is_plain_stage3, which leaves ZenFlow out), with every sub-group's fp32
    state and fp16 partition in host memory (`offload_param` + `offload_optimizer`, the configuration
    measured), stepped by DeepSpeedCPUAdam."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return (type(getattr(opt, "optimizer", None)) is DeepSpeedCPUAdam
            and bool(getattr(opt, "offload_optimizer", False)) and not getattr(opt, "swap_optimizer", False)
            and not getattr(opt, "use_muon", False) and getattr(opt, "torch_autocast_gradscaler", None) is None
            and all(getattr(opt, "subgroup_to_device", {}).get(i) == "cpu" and flat is not None
                    and flat.device.type == "cpu" for i, flat in enumerate(opt.fp16_partitioned_groups_flat)))


def _steps_plainly(adam: Any) -> bool:
    """Nothing expects DeepSpeedCPUAdam.step itself to run this step: no step hooks (its own or global),
    and no step replaced on the instance but a torch LR scheduler's, which only notes that a step ran
    (`_opt_called`, set here too). Hugging Face Trainer builds its scheduler on this optimizer."""
    from torch.optim import optimizer as torch_optimizer

    replaced = vars(adam).get("step")
    return not (adam._optimizer_step_pre_hooks or adam._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks
                or (replaced is not None and not _is_lr_scheduler_counter(replaced, adam)))


def _is_lr_scheduler_counter(step: Any, adam: Any) -> bool:
    return getattr(step, "_wrapped_by_lr_sched", False) and getattr(step, "__wrapped__", None) is type(adam).step


PATCHED = ("unscale_and_clip_grads", "_optimizer_step")  # set on the instance by apply


def apply(opt: Any) -> None:
    opt.z3guard_fused = {}  # sub-group -> "scale" (its factor, pending) or "written"
    opt.z3guard_stock_unscale = opt.unscale_and_clip_grads
    opt.z3guard_stock_optimizer_step = opt._optimizer_step
    opt.unscale_and_clip_grads = types.MethodType(_unscale_and_clip_grads, opt)
    opt._optimizer_step = types.MethodType(_optimizer_step, opt)


def take_written(opt: Any, sub_group_id: int) -> bool:
    """True when the fused step already wrote this sub-group's fp16 partition (the write-back then
    only unflattens it)."""
    return getattr(opt, "z3guard_fused", {}).pop(sub_group_id, None) == "written"


def _unscale_and_clip_grads(self, sub_group_id: int, total_norm) -> None:
    # DeepSpeed 0.19's factor, applied later chunk by chunk.
    if not _steps_plainly(self.optimizer):
        hostgrads.materialise(self, sub_group_id)  # stock's reads the fp32 gradients in memory
        return self.z3guard_stock_unscale(sub_group_id, total_norm)
    combined_scale = self.loss_scale
    if self.clip_grad > 0.:
        clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * self.loss_scale
    self.z3guard_fused[sub_group_id] = ("scale", 1. / combined_scale)


def _optimizer_step(self, sub_group_id: int) -> None:
    pending = self.z3guard_fused.pop(sub_group_id, None)
    if pending is None:  # not after our unscale (a caller of its own): stock
        hostgrads.materialise(self, sub_group_id)
        return self.z3guard_stock_optimizer_step(sub_group_id)
    _, factor = pending
    adam = self.optimizer
    group = adam.param_groups[self.sub_group_to_group_id[sub_group_id]]
    fp32 = self.fp32_partitioned_groups_flat[sub_group_id]
    state = adam.state[fp32]
    if len(state) == 0:  # as DeepSpeedCPUAdam.step initialises it
        state_dtype = torch.float if adam.fp32_optimizer_states else fp32.dtype
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(fp32.data, dtype=state_dtype, device="cpu")
        state["exp_avg_sq"] = torch.zeros_like(fp32.data, dtype=state_dtype, device="cpu")
    state["step"] += 1
    if "step" in vars(adam):  # a torch LR scheduler's counter (see _steps_plainly)
        adam._opt_called = True
    fused_update(adam, group, state, fp32.data, fp32.grad.data, self.fp16_partitioned_groups_flat[sub_group_id].data,
                 factor, runs=hostgrads.runs_for_step(self, sub_group_id))
    hostgrads.stepped(self, sub_group_id, factor)
    self.z3guard_fused[sub_group_id] = "written"


def fused_update(adam: Any, group: dict, state: dict, param: torch.Tensor, grad: torch.Tensor, low: torch.Tensor,
                 factor: Any, chunk_numel: int = CHUNK_NUMEL, runs: Sequence[hostgrads.Run] = ()) -> None:
    """`grad *= factor`, DeepSpeedCPUAdam's update of `param`, `low.copy_(param)`: chunk by chunk.
    `state["step"]` is this step's (already incremented). Where `runs` cover the gradient, it is read
    from their regions into a scratch chunk instead (hostgrads.py), and `grad` is written only where a
    chunk is partly covered."""
    from .fastpaths import cast_copy_

    beta1, beta2 = group["betas"]
    param, grad, low = param.view(-1), grad.view(-1), low.view(-1)
    exp_avg, exp_avg_sq = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    scratch = torch.empty(min(chunk_numel, param.numel()), dtype=grad.dtype) if runs else None
    r = 0  # runs are sorted: the first one that may reach this chunk
    for start in range(0, param.numel(), chunk_numel):
        end = min(start + chunk_numel, param.numel())
        while r < len(runs) and runs[r].end <= start:
            r += 1
        g, mixed = grad[start:end], False
        if r < len(runs) and runs[r].start < end:
            g, mixed = _from_runs(scratch[:end - start], grad, runs, r, start, end)
        g.mul_(factor)
        if mixed:  # what no run covers stays in memory, unscaled, as stock's in-place unscale leaves it
            grad[start:end].copy_(g)
        adam.ds_opt_adam.adam_update(adam.opt_id, state["step"], group["lr"], beta1, beta2, group["eps"],
                                     group["weight_decay"], group["bias_correction"], param[start:end], g,
                                     exp_avg[start:end], exp_avg_sq[start:end])
        cast_copy_(low[start:end], param[start:end])


def _from_runs(g: torch.Tensor, grad: torch.Tensor, runs: Sequence[hostgrads.Run], r: int, start: int,
               end: int) -> tuple[torch.Tensor, bool]:
    """The chunk [start, end) of the gradient in `g`, from the runs where they cover it, else from `grad`;
    and whether some of it came from `grad`."""
    spans = [(max(run.start, start), min(run.end, end), run) for run in itertools.takewhile(
        lambda run: run.start < end, runs[r:])]
    mixed = sum(b - a for a, b, _ in spans) < end - start
    if mixed:
        g.copy_(grad[start:end])
    for a, b, run in spans:
        g[a - start:b - start].copy_(run.source[a - run.start:b - run.start])
    return g, mixed
