"""`deepspeed.zero.GatheredParameters` entered inside a module's forward.

Stock gathers the parameters that are partitioned when it is entered and, on leaving, partitions every
parameter it was given. Inside a forward some of them belong to the coordinator at that moment: prefetched
for a later module (stock hands out the unfilled all-gather buffer, then raises "Cannot partition a param
in flight"), or fetched for a module that is running (stock frees them under it). Here, while a guarded
forward runs and nothing is to be broadcast (`modifier_rank=None`), such parameters are taken as that
forward's own reads (one in flight is waited for) and left to the coordinator; the context gathers and
partitions the others, as stock does. Outside a forward, and with a `modifier_rank`, it is stock's."""
from __future__ import annotations

import functools
from typing import Callable

from torch import nn

from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus


# Set on a parameter in flight that a read through parameters() or state_dict() in a forward waited for:
# available now, yet still the coordinator's prefetch for a later module.
WAITED = "_z3guard_waited_in_flight"


def patch(read_in_forward: Callable[[nn.Parameter], bool]) -> Callable[[], None]:
    """Patch `GatheredParameters.__enter__`; returns what restores it. `read_in_forward(param)`: the read of
    a gathered or in-flight parameter by the forward that runs now, filled on return; False where no guarded
    forward runs."""
    original = GatheredParameters.__enter__

    @functools.wraps(original)
    def __enter__(self):
        params = getattr(self, "params", None)  # what stock keeps from 0.9 to 0.19.8; otherwise stock's alone
        if params and getattr(self, "enabled", False) and getattr(self, "src_rank", 0) is None:
            held = {id(p) for p in params if _held(p) and read_in_forward(p)}
            if held:
                self.params = [p for p in params if id(p) not in held]
                self.enabled = bool(self.params)
        return original(self)

    GatheredParameters.__enter__ = __enter__
    return lambda: setattr(GatheredParameters, "__enter__", original)


def _held(param) -> bool:
    """The coordinator's now: prefetched (in flight, or waited for by a read in this forward), or fetched
    for a module that has not released it. A persistent parameter no module holds is not (stock's context
    partitions it; the guard gathers it again). Asked of the parameter itself, not of DeepSpeed's stack of
    running modules: between steps that stack can still hold entries a checkpoint recompute left, so a
    context entered there would look like a forward's."""
    waited = getattr(param, WAITED, False)
    if waited:  # a read's wait counts for the context that follows it, not for later ones
        setattr(param, WAITED, False)
    return param.ds_status == ZeroParamStatus.INFLIGHT or (
        param.ds_status == ZeroParamStatus.AVAILABLE and (bool(param.ds_active_sub_modules) or waited))
