"""Fetch each repeated block whole: the model's repeated blocks (a transformer's layers) become ZeRO-3
leaf modules before DeepSpeed registers its hooks.

Why: ZeRO-3 fetches and releases per module, through Python hooks around every module's forward and
backward (a GPT-2 block has thirteen modules, seven of them with no parameters of their own). At GPT-2-medium
size on H200s those hooks, not the copies, are most of the forward and backward with offload: b58 measured
the both-offloads step 480 -> 321-343 ms with whole blocks (forward 138 -> 73-80 ms). FSDP2 gathers per
block for the same reason. DeepSpeed's leaf modules do exactly this (one fetch, one release per block) and
change no arithmetic: each gradient is the same sum and is reduced once, after its block's backward.

Which modules: the same-class children of an `nn.ModuleList` / `nn.Sequential` that occur at least twice,
hold parameters in at least two modules, fit in `stage3_max_live_parameters` (DeepSpeed's own bound on
gathered parameters), and hold no container of modules (experts chosen per step: a leaf would fetch every
expert, where ZeRO-3 fetches the ones that run). Nothing is marked where the user marked a leaf module or
set `stage3_module_granularity_threshold`: the fetch granularity is theirs then.
"""
from __future__ import annotations

import collections
from typing import Any

from torch import nn

MARK = "_z3guard_block"  # on the modules marked here: what `marked` counts
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def repeated_blocks(model: nn.Module, max_numel: int) -> list[nn.Module]:
    """The modules to fetch whole, outermost first; none inside another."""
    from deepspeed.utils import z3_leaf_module

    if any(z3_leaf_module(m) for m in model.modules()):
        return []
    found: list[nn.Module] = []
    _collect(model, max_numel, found)
    return found


def mark(model: nn.Module, max_numel: int) -> int:
    """Make `model`'s repeated blocks ZeRO-3 leaf modules; returns how many. Must run before DeepSpeed
    registers its hooks: a leaf's children get none, and its gradients are reduced after its backward."""
    from deepspeed.utils import set_z3_leaf_module

    blocks = repeated_blocks(model, max_numel)
    for block in blocks:
        set_z3_leaf_module(block, True)
        setattr(block, MARK, True)
    return len(blocks)


def before_hooks(model: nn.Module, settings: dict[str, Any]) -> int:
    """Mark `model`'s blocks from DeepSpeedZeRoOffload's arguments, unless the user chose the granularity
    (a granularity threshold) or ZenFlow runs (its hooks transpose a module's parameters per fetch)."""
    if settings.get("zero_module_granularity_threshold") or settings.get("zenflow"):
        return 0
    return mark(model, int(settings["max_live_parameters"]))


def marked(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if getattr(m, MARK, False))


def _collect(module: nn.Module, max_numel: int, found: list[nn.Module]) -> None:
    blocks = set()
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        by_class = collections.Counter(type(child) for child in module.children())
        blocks = {id(child) for child in module.children()
                  if by_class[type(child)] >= 2 and _fits(child, max_numel)}
    for child in module.children():
        if id(child) in blocks:
            found.append(child)
        else:
            _collect(child, max_numel, found)


def _fits(block: nn.Module, max_numel: int) -> bool:
    with_params = [m for m in block.modules() if next(m.parameters(recurse=False), None) is not None]
    return (len(with_params) >= 2 and not any(isinstance(m, CONTAINERS) for m in block.modules())
            and sum(_numel(p) for p in block.parameters()) <= max_numel)


def _numel(param: nn.Parameter) -> int:
    return getattr(param, "ds_numel", None) or param.numel()  # built under zero.Init: partitioned already
