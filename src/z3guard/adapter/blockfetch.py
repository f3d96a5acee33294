"""Fetch each repeated block whole: the model's repeated blocks (a transformer's layers) become ZeRO-3
leaf modules before DeepSpeed registers its hooks.

Why: ZeRO-3 fetches and releases per module, through Python hooks around every module's forward and
backward (a GPT-2 block has thirteen modules, seven of them with no parameters of their own). At GPT-2-medium
size on 2 x H200 those hooks, not the copies, are most of the forward and backward with offload: the
both-offloads step went from 480 to 321-343 ms with whole blocks (forward 138 -> 73-80 ms; docs/benchmarks.md).
FSDP2 gathers per block for the same reason. A DeepSpeed leaf module is fetched once and released once.

Only the fetch changes. DeepSpeed's optimizer gives a leaf's parameters no gradient hook of their own: it
reduces them all after the leaf's backward, in their registration order, with a zero gradient for a
parameter the step did not use. That moves gradients to other offsets of the reduction buckets (at 3 or more
ranks the collective then adds the ranks' values in another order) and overwrites the gradient region that
stock leaves as it was for an unused parameter. So `after_hooks` hands the blocks' parameters back to stock's
gradient path before the optimizer registers its hooks: each gradient is reduced when autograd produces it,
in stock's order, and an unused one is not touched. Each block then holds at most its parameters gathered
and, as in stock, the gradients not yet reduced.

Which modules: the same-class children of an `nn.ModuleList` / `nn.Sequential` that occur at least twice,
hold parameters in at least two modules, hold no more parameters than the model's largest single module
(stock gathers that one whole: a block no larger gathers no more at once, so the memory peak does not rise;
a block of 0.8B parameters beside 0.27B modules raised it 10% on one H200), fit in
`stage3_max_live_parameters` (DeepSpeed's own bound on gathered parameters), and hold no container of
modules (experts chosen per step: a leaf would fetch every expert, where ZeRO-3 fetches the ones that run).
Nothing is marked where the user marked a leaf module or set `stage3_module_granularity_threshold`: the
fetch granularity is theirs then, and their leaf modules keep DeepSpeed's own gradient path.
"""
from __future__ import annotations

import collections
from typing import Any

from torch import nn

MARK = "_z3guard_block"  # on the modules marked here: what `marked` counts
OWNER = "_z3guard_block_of"  # on their parameters, in place of DeepSpeed's `ds_z3_leaf_module`
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def repeated_blocks(model: nn.Module, max_numel: int) -> list[nn.Module]:
    """The modules to fetch whole, outermost first; none inside another."""
    from deepspeed.utils import z3_leaf_module

    if any(z3_leaf_module(m) for m in model.modules()):
        return []
    found: list[nn.Module] = []
    _collect(model, min(max_numel, largest_module(model)), found)
    return found


def largest_module(model: nn.Module) -> int:
    """The most parameters one module holds of its own: the most stock ZeRO-3 gathers at once."""
    return max((sum(_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


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
    if str(getattr(settings.get("offload_param_config"), "device", "none")).endswith("nvme"):
        return _off("with NVMe parameter offload: a block swaps in all its partitions at once, more than "
                    "the swapper's buffers may hold")
    return mark(model, int(settings["max_live_parameters"]))


def after_hooks(model: nn.Module) -> int:
    """After DeepSpeed registered the module hooks, before its optimizer registers the gradient hooks: the
    marked blocks' parameters stop being leaf parameters to the optimizer, so each gets stock's gradient
    hook (see above). Returns how many parameters were handed back."""
    handed = 0
    for block in model.modules():
        if getattr(block, MARK, False):
            for param in block.parameters():
                if getattr(param, "ds_z3_leaf_module", None) is block:
                    del param.ds_z3_leaf_module
                    setattr(param, OWNER, block)
                    handed += 1
    return handed


def block_of(param: nn.Parameter) -> nn.Module | None:
    """The block that fetches `param` whole: DeepSpeed's leaf module or one marked here."""
    return getattr(param, "ds_z3_leaf_module", None) or getattr(param, OWNER, None)


def _off(reason: str) -> int:
    import logging

    from . import speedpaths

    speedpaths.say_off("block_fetch", reason, logging.WARNING)
    return 0


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
