"""What a guarded engine must keep of stock DeepSpeed's contract, beside stock engines in one gloo group:
save/load signatures (Trainer inspects them), positional arguments, a load from a folder with no
checkpoint, a weights-only load, a refused `set_data_position`, a guard that fails part-way, and a save
that fails on one rank only. Writes <out>/contract.rank<r>.json. Run on every rank (gloo on CPU, NCCL
where there are GPUs)."""
from __future__ import annotations

import inspect
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

import z3guard
from z3guard import adapter
from z3guard.checkpoint import state
from z3guard.scenarios.job import limit_file_size

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3}}


OFFLOAD = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}


def engine(guarded: bool, stage: int = 3, width: int = 16, offload: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
    cfg = {**CONFIG, "zero_optimization": {"stage": stage, **(OFFLOAD if offload else {})},
           "zero_force_ds_cpu_optimizer": False} if stage == 3 else \
        {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    e, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    if guarded:
        z3guard.guard(e)
    return e


def train_step(e) -> None:
    x = torch.randn(2, 16, dtype=next(e.module.parameters()).dtype, device=e.device)
    e.backward(e(x).float().pow(2).mean())
    e.step()


def outcome(action: Callable[[], Any]) -> str:
    try:
        return f"ok: {action()!r}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def main(out: Path) -> None:
    if torch.cuda.is_available():  # on GPUs (bench/gpu.sh): NCCL, a device per rank
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        deepspeed.init_distributed(dist_backend="nccl")
    else:
        deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    r: dict[str, Any] = {}
    stock, guarded = engine(False), engine(True)
    for name in ("save_checkpoint", "load_checkpoint"):
        r[f"signature/{name}"] = [[str(p) for p in inspect.signature(getattr(e, name)).parameters.values()]
                                  for e in (stock, guarded)]
    r["guarded"] = [sorted({"save_checkpoint", "load_checkpoint"} & set(vars(e))) for e in (stock, guarded)]

    # positional arguments, as far as DeepSpeed's own signature goes
    train_step(guarded)
    r["save/positional"] = outcome(lambda: guarded.save_checkpoint(str(out / "ckpt"), "pos", {"k": 1}, True, False))
    r["save/positional_manifest"] = (out / "ckpt" / "pos" / "z3guard-manifest.json").is_file()
    fresh = engine(True)
    r["load/positional"] = outcome(lambda: fresh.load_checkpoint(str(out / "ckpt"), "pos", True)[1]["k"])

    # no checkpoint saved yet (another run's logs may sit there): stock's answer, not an error
    (out / "empty" / "logs").mkdir(parents=True, exist_ok=True)
    r["load/empty"] = [outcome(lambda: e.load_checkpoint(str(out / "empty"))) for e in (stock, fresh)]

    # a weights-only load (warm start) keeps this run's RNG streams; a full load restores the saved ones
    warm = engine(True)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    warm.load_checkpoint(str(out / "ckpt"), "pos", load_module_only=True)
    r["load/module_only_keeps_rng"] = torch.equal(before, torch.get_rng_state())
    r["load/module_only_resumed_state"] = z3guard.resumed_state(warm) is not None
    full = engine(True)
    full.load_checkpoint(str(out / "ckpt"), "pos")
    r["load/full_restores_rng"] = torch.equal(state.load(out / "ckpt" / "pos")["torch_rng"], torch.get_rng_state())

    # not ZeRO-3: nothing to save the position with
    r["set_data_position/stage0"] = outcome(lambda: z3guard.set_data_position(engine(False, stage=0), 5))

    # a guard that fails part-way leaves the engine as stock left it
    ad = adapter.load()
    victim = engine(False)

    def fail(*args: Any) -> list[str]:
        raise RuntimeError("injected")

    strict = z3guard.GuardOptions(strict=True)
    ad.apply_fast_paths, keep = fail, ad.apply_fast_paths
    lenient = engine(False)
    r["guard/failing_lenient"] = outcome(lambda: z3guard.guard(lenient))  # warns once, runs as stock
    r["guard/lenient_still_works"] = outcome(lambda: train_step(lenient))
    r["guard/failing"] = outcome(lambda: z3guard.guard(victim, strict))
    ad.apply_fast_paths = keep
    r["guard/rolled_back"] = {
        "own_save_load": sorted({"save_checkpoint", "load_checkpoint"} & set(vars(victim))),
        "guarded_coordinators": [type(c).__name__ for c in ad.coordinators(victim) if isinstance(c, ad.guarded_class)],
        "still_works": outcome(lambda: train_step(victim))}

    # ... also where it fails inside the fast paths, after some were set on the optimizer
    from z3guard.adapter import fastpaths, persistent

    r["guard/offload_fast_paths"] = z3guard.guard(engine(False, offload=True)).fast_paths
    late = engine(False, offload=True)
    persistent.apply, keep_apply = fail, persistent.apply  # the last but one to be set
    r["guard/failing_late"] = outcome(lambda: z3guard.guard(late, strict))
    persistent.apply = keep_apply
    r["guard/late_rolled_back"] = {
        "optimizer_attributes": sorted(n for n in vars(late.optimizer)
                                       if n in fastpaths.PATCHED or n.startswith("z3guard_")),
        "own_save_load": sorted({"save_checkpoint", "load_checkpoint"} & set(vars(late))),
        "still_works": outcome(lambda: train_step(late))}

    # a save phase that fails on rank 1 only fails on both ranks, publishes nothing and leaves no one waiting
    save, keep_save = state.save, state.save

    def rank1_fails(folder: Path, s: dict) -> None:
        if rank == 1:
            raise OSError(28, "No space left on device (injected)", str(folder))
        keep_save(folder, s)

    state.save = rank1_fails
    r["save/one_rank_fails"] = outcome(lambda: guarded.save_checkpoint(str(out / "ckpt"), "late"))
    state.save = save
    r["save/latest_after_failure"] = (out / "ckpt" / "latest").read_text()
    r["save/published_after_failure"] = (out / "ckpt" / "late").exists()
    # a write inside DeepSpeed's own save failing on rank 1 only (a full disk there), between DeepSpeed's
    # collectives: the same, with no rank left waiting in them
    big = engine(True, width=1024)  # rank 1's optimizer file: ~6 MB, past the limit
    train_step(big)
    previous = limit_file_size(1 << 20) if rank == 1 else None
    r["save/one_rank_disk_full"] = outcome(lambda: big.save_checkpoint(str(out / "ckpt"), "full"))
    if previous is not None:
        limit_file_size(previous)
    r["save/published_after_disk_full"] = (out / "ckpt" / "full").exists()
    r["save/latest_after_disk_full"] = (out / "ckpt" / "latest").read_text()
    (out / f"contract.rank{rank}.json").write_text(json.dumps(r, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except Exception:
        traceback.print_exc()
        raise
