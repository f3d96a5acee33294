"""Fetch each repeated block whole: the model's repeated blocks (a transformer's layers) become ZeRO-3
leaf modules before DeepSpeed registers its hooks.

Why: ZeRO-3 fetches and releases per module, through Python hooks around every module's forward and
backward (a GPT-2 block has thirteen modules, seven of them with no parameters of their own). At GPT-2-medium
size on 2 x H200 those hooks, not the copies, are most of the forward and backward with offload: the
both-offloads step went from 480 to 321-343 ms with whole blocks (forward 138 -> 73-80 ms; docs/benchmarks.md).
FSDP2 gathers per block for the same reason. DeepSpeed's leaf modules do exactly this (one fetch, one
release per block); each gradient is the same sum, reduced once, after its block's backward.

Only at 1 or 2 ranks: a leaf's gradients are reduced together after its backward, so they sit at other
offsets of the reduction buckets than stock's. With 3 or more ranks the collective then adds the ranks'
values in another order for some elements, and the result can differ from stock's in the last bits (3 gloo
ranks: a loss after 15 steps; tests/test_world_sizes.py). With 2 ranks a sum has one order.

Which modules: the same-class children of an `nn.ModuleList` / `nn.Sequential` that occur at least twice,
hold parameters in at least two modules, hold no more parameters than the model's largest single module
(stock gathers that one whole, with its full gradient: a block no larger gathers no more at once, so the
memory peak does not rise; a block of 0.8B parameters beside 0.27B modules raised it 10% on one H200), fit
in `stage3_max_live_parameters` (DeepSpeed's own bound on gathered parameters), and hold no container of
modules (experts chosen per step: a leaf would fetch every expert, where ZeRO-3 fetches the ones that run).
Nothing is marked where the user marked a leaf module or set `stage3_module_granularity_threshold`: the
fetch granularity is theirs then.
"""
from __future__ import annotations

import collections
from typing import Any

from torch import nn

MARK = "_z3guard_block"  # on the modules marked here: what `marked` counts
PROVEN_RANKS = 2  # the most ranks at which a whole-block fetch reduces in stock's order (see above)
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
    (a granularity threshold), ZenFlow runs (its hooks transpose a module's parameters per fetch) or more
    ranks reduce the gradients than the path is bit-identical for."""
    if settings.get("zero_module_granularity_threshold") or settings.get("zenflow"):
        return 0
    ranks = reducing_ranks(settings.get("dp_process_group"))
    if ranks > PROVEN_RANKS:
        return _off(f"at {ranks} ranks: its gradients would be summed in another order than stock's "
                    "(bit-identical at 1 or 2 ranks)")
    if str(getattr(settings.get("offload_param_config"), "device", "none")).endswith("nvme"):
        return _off("with NVMe parameter offload: a block swaps in all its partitions at once, more than "
                    "the swapper's buffers may hold")
    return mark(model, int(settings["max_live_parameters"]))


def _off(reason: str) -> int:
    import logging

    from . import speedpaths

    speedpaths.say_off("block_fetch", reason, logging.WARNING)
    return 0


def reducing_ranks(group: Any) -> int:
    """How many ranks reduce the gradients: the data-parallel group DeepSpeed passes (None: all)."""
    import torch.distributed as dist

    return dist.get_world_size(group=group) if dist.is_available() and dist.is_initialized() else 1


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
