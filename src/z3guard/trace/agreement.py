"""Ranks decide together: what one rank learns about the trace, every rank applies, at the same point.

ZeRO-3 stays correct only while every rank issues the same gathers in the same order. A cross-module read
that happens on one rank only (it depends on the data) must therefore not change that rank's trace alone:
the read is noted, and at the next step boundary (the coordinator's `reset_step`, which every rank reaches
once per forward) the ranks exchange what they noted and every rank registers the union. The exchange is
one all-reduce of two numbers when nobody noted anything (nearly every step), over a gloo group, so it
never waits on the GPU's queue. The second number carries one more decision that all ranks must take
together: to drop a recording that can no longer become a trace.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class RankAgreement:
    """The group the ranks agree over: the engine's data-parallel ranks, on gloo (CPU tensors)."""

    def __init__(self, group: Any = None) -> None:
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.group = group
        self._cpu_group_made = not self.active or dist.get_backend(group) == "gloo"
        self.device = torch.device("cpu")

    def _cpu_group(self) -> Any:
        """Made at the first exchange, a point every rank reaches (not when one rank guards an engine).
        Only where the data-parallel group is the world: a group of some ranks must be made by every rank
        of the world in one order, which the other groups' ranks would not do here. Elsewhere the
        exchange runs on DeepSpeed's own group, with device tensors."""
        if not self._cpu_group_made:
            if dist.get_world_size(self.group) == dist.get_world_size():
                self.group = dist.new_group(backend="gloo")
            else:
                from deepspeed.accelerator import get_accelerator

                self.device = torch.device(get_accelerator().current_device_name())
            self._cpu_group_made = True
        return self.group

    def union(self, local: list[tuple[int, int]], flag: bool = False) -> tuple[list[tuple[int, int]], bool]:
        """Every rank's `local` items, on every rank, in one order; and whether any rank raised `flag`."""
        if not self.active:
            return sorted(set(local)), flag
        group = self._cpu_group()
        count = torch.tensor([len(local), int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        flagged = bool(count[1].item())
        if int(count[0].item()) == 0:
            return [], flagged
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, local, group=group)
        return sorted({tuple(item) for items in everyone for item in items}), flagged
