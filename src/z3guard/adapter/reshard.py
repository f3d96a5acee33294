"""Load a ZeRO-3 checkpoint saved on N ranks into an engine on M ranks, straight from the N files.

Stage 3 keeps, per rank, one flat fp32 partition per optimizer sub-group, and the Adam moments beside it.
Laid end to end over the sub-groups, a rank's partitions are every parameter's slice in the optimizer's
order, each `ceil(numel / N)` long (the last rank's padded), the layout DeepSpeed's `zero_to_fp32` reads.
A rank at M needs `ceil(numel / M)` elements of each parameter from offset `rank * ceil(numel / M)`; it
reads the saved files one at a time, copies the slices it owns into its own layout (its sub-groups may
split elsewhere), and hands the result to DeepSpeed's own `load_state_dict`. Memory: its own partition
plus one saved file. Nothing is written to disk.

Saved rank r's model-states file (buffers, scheduler, client state) is read by new rank r, and by rank
r' >= N from saved rank r' mod N.
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..checkpoint.errors import CheckpointError

log = logging.getLogger("z3guard")
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class SavedLayout:
    """What the N saved files hold, read from saved rank 0's model states."""

    folder: Path
    world: int
    shapes: list[tuple[str, tuple[int, ...]]]  # every trainable parameter, in the optimizer's order
    frozen: list[str]
    bf16_names: bool  # DeepSpeed names the optimizer files bf16_zero_pp_rank_* under bf16

    def optim_file(self, rank: int) -> Path:
        prefix = "bf16_" if self.bf16_names else ""
        return self.folder / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"

    def model_file(self, rank: int) -> Path:
        return self.folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def read_layout(folder: Path) -> SavedLayout:
    """The saved layout; a missing file or a checkpoint that is not ZeRO-3's raises CheckpointError naming it."""
    folder = Path(folder)
    first = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if not first.is_file():
        raise CheckpointError(f"{first}: missing; not a ZeRO-3 checkpoint, or an incomplete one")
    states = torch.load(first, map_location="cpu", weights_only=False)
    world = int(states["dp_world_size"])
    groups = states.get("param_shapes") or []
    shapes = [(name, tuple(shape)) for group in groups for name, shape in group.items()]
    frozen = list((states.get("frozen_param_shapes") or {}).keys())
    bf16 = (folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    layout = SavedLayout(folder, world, shapes, frozen, bf16)
    missing = [p for r in range(world) for p in (layout.optim_file(r), layout.model_file(r)) if not p.is_file()]
    if missing:
        raise CheckpointError(f"{missing[0]}: missing; the checkpoint was saved on {world} ranks and "
                              f"{len(missing)} of their files are absent. Load an older checkpoint.")
    return layout


def problems(layout: SavedLayout, engine: Any, names: dict[int, str]) -> list[str]:
    """Why this engine cannot take the saved partitions: other parameters or shapes, frozen parameters,
    optimizer state on NVMe. `names`: parameter id -> name."""
    opt = engine.optimizer
    found = []
    if layout.frozen:
        found.append(f"{len(layout.frozen)} frozen parameter(s) ({layout.frozen[0]}, ...) are saved as per-rank "
                     "fragments, which z3guard does not re-partition; load on the saved number of ranks")
    if getattr(opt, "swap_optimizer", False) or getattr(opt, "params_in_nvme_and_cpu", False):
        found.append("the optimizer state is swapped to NVMe; re-partitioning it is not supported")
    ours = [(names.get(id(p), "?"), tuple(p.ds_shape)) for group in opt.fp16_groups for p in group]
    if ours != layout.shapes:
        saved = dict(layout.shapes)
        mine = dict(ours)
        gone = [n for n in saved if n not in mine]
        new = [n for n in mine if n not in saved]
        other = [n for n in saved if n in mine and saved[n] != mine[n]]
        if other:
            found.append(f"parameter '{other[0]}' is {mine[other[0]]} in the model, {saved[other[0]]} in the checkpoint")
        elif gone or new:
            found.append(f"parameters differ: {', '.join(gone[:3]) or 'none'} only in the checkpoint, "
                         f"{', '.join(new[:3]) or 'none'} only in the model")
        else:
            found.append("the optimizer orders the parameters differently from the checkpoint")
    return found


def _saved_offsets(layout: SavedLayout) -> list[int]:
    """Each parameter's offset in a saved rank's end-to-end partitions."""
    offsets, at = [], 0
    for _, shape in layout.shapes:
        offsets.append(at)
        at += math.ceil(math.prod(shape) / layout.world)
    return offsets


def rank_state_dict(engine: Any, layout: SavedLayout, rank: int, world: int) -> dict[str, Any]:
    """This rank's stage-3 optimizer state at `world` ranks, in DeepSpeed's own format, filled from the
    saved files one at a time."""
    opt = engine.optimizer
    template = opt.state_dict()
    flats = [torch.zeros_like(t) for t in template["fp32_flat_groups"]]
    live = template["optimizer_state_dict"]  # its state dicts are the optimizer's own: copied, not changed
    inner = {**live, "state": {g: dict(s) for g, s in live["state"].items()},
             "param_groups": [dict(pg) for pg in live["param_groups"]]}
    # Adam's moments per sub-group, as saved (a torch optimizer makes its state at the first step only)
    moments: dict[int, dict[str, torch.Tensor]] = {g: {} for g in range(len(flats))}
    # where each parameter's slice lands here: (sub-group, offset in it, first element of it, its length)
    targets, i = [], 0
    for g, group in enumerate(opt.fp16_groups):
        at = 0
        for p in group:
            size = p.partition_numel()
            start = rank * size
            targets.append((i, g, at, start, max(0, min(size, p.ds_numel - start))))
            at += size
            i += 1
    offsets = _saved_offsets(layout)
    saved_inner: dict[str, Any] = {}
    scaler: dict[str, Any] = {}
    for r in range(layout.world):
        sd = torch.load(layout.optim_file(r), map_location="cpu", weights_only=False)["optimizer_state_dict"]
        groups = sorted(sd["optimizer_state_dict"]["state"])
        saved = {"fp32": torch.cat([t.float().reshape(-1) for t in sd["fp32_flat_groups"]])}
        for key in MOMENTS:
            parts = [sd["optimizer_state_dict"]["state"][g].get(key) for g in groups]
            if all(t is not None for t in parts) and parts:
                saved[key] = torch.cat([t.reshape(-1) for t in parts])
        if r == 0:
            saved_inner = sd["optimizer_state_dict"]
            scaler = {k: sd[k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow")}
        for i, g, at, start, length in targets:
            numel = math.prod(layout.shapes[i][1])
            size_n = math.ceil(numel / layout.world)
            lo, hi = max(start, r * size_n), min(start + length, (r + 1) * size_n, numel)
            if lo >= hi:
                continue
            src = offsets[i] + lo - r * size_n
            dst = at + lo - start
            flats[g][dst:dst + hi - lo].copy_(saved["fp32"][src:src + hi - lo])
            for key in MOMENTS:
                if key in saved:
                    if key not in moments[g]:
                        moments[g][key] = torch.zeros_like(flats[g])
                    moments[g][key][dst:dst + hi - lo].copy_(saved[key][src:src + hi - lo])
        del sd, saved
    first = saved_inner["state"][min(saved_inner["state"])] if saved_inner.get("state") else {}
    for g in range(len(flats)):
        if not moments[g]:  # saved before any step: nothing to restore
            continue
        state = inner["state"].setdefault(g, {})
        state.update(moments[g])
        if "step" in first:
            state["step"] = first["step"].clone() if torch.is_tensor(first["step"]) else first["step"]
    for mine, theirs in zip(inner["param_groups"], saved_inner.get("param_groups", [])):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
    return {**template, **scaler, "partition_count": world, "fp32_flat_groups": flats,
            "optimizer_state_dict": inner}


@contextlib.contextmanager
def loading_from(engine: Any, layout: SavedLayout) -> Iterator[None]:
    """While stock `load_checkpoint` runs: this rank reads saved rank `rank mod N`'s model states, and the
    optimizer state comes from `rank_state_dict` instead of the one file stock would read (and refuse)."""
    group = engine.optimizer.dp_process_group
    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    source = rank % layout.world
    original_name = engine._get_ckpt_name

    def ckpt_name(*args: Any, **kwargs: Any) -> str:
        return re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{source}_", original_name(*args, **kwargs))

    def load_zero_checkpoint(load_dir: str, tag: str, load_optimizer_states: bool = True) -> bool:
        states: list[Any] = [None] * world
        states[rank] = rank_state_dict(engine, layout, rank, world)
        engine.optimizer.load_state_dict(state_dict_list=states, load_optimizer_states=load_optimizer_states,
                                         load_from_fp32_weights=engine.zero_load_from_fp32_weights())
        log.info("z3guard: rank %d of %d loaded its partitions from the %d saved ones in %s", rank, world,
                 layout.world, layout.folder)
        return True

    replaced = {"_get_ckpt_name": ckpt_name, "_load_zero_checkpoint": load_zero_checkpoint}
    before = {name: engine.__dict__.get(name) for name in replaced}
    engine.__dict__.update(replaced)
    try:
        yield
    finally:
        for name, method in before.items():
            if method is None:
                del engine.__dict__[name]
            else:
                engine.__dict__[name] = method
