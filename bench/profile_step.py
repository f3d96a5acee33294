"""Where one ZeRO-3 step spends its time: phase timers (device-synchronised) and torch.profiler's top ops,
stock against z3guard, for one model and offload setting. Run on every rank by torchrun:

    torchrun --nproc_per_node 2 bench/profile_step.py --offload param+optimizer --device cuda
    ... --timers-only --warmup 12 --steps 20    # the phase timers alone, no profiler inflating them

Rank 0 prints the tables and writes bench/results/profile-<device>-<offload>.json.
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import typer

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))
import models  # noqa: E402
from worker import GUARD_OPTIONS, config, make_engine, timed_step  # noqa: E402

# Stage-3 optimizer methods timed one by one (DeepSpeed 0.19); missing ones are skipped.
PHASES = ["optimizer.step", "has_overflow", "_overflow_check_and_loss_scale_update", "_get_norm_groups",
          "_loss_scale_update_and_overflow_cleanup", "unscale_and_clip_grads", "_optimizer_step",
          "_reassign_or_swap_out_partitioned_parameters", "_post_step", "_partition_all_parameters", "_pre_step",
          "partition_grads"]


def _timed(obj, key: str, totals: dict[str, list[float]], sync) -> None:
    name = key.removeprefix("optimizer.")
    original = getattr(obj, name, None)
    if original is None:
        return

    def timed(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sync()
            totals.setdefault(key, []).append(time.perf_counter() - t0)

    setattr(obj, name, timed)


def profile(variant: str, offload: str, model: str, steps: int, device: torch.device, world: int,
            warmup: int = 3, timers_only: bool = False, alternate: bool = False) -> list[dict]:
    import z3guard

    z3guard.uninstall()
    if variant in GUARD_OPTIONS:
        z3guard.install(z3guard.GuardOptions(warn=False, **GUARD_OPTIONS[variant]))
    size = models.Size.of(device.type, model)
    cfg = config(variant, offload, size.batch, world, device.type)
    engine, size, sync = make_engine(model, cfg, device.type)
    phases: dict[str, list[float]] = {}

    def one(step: int) -> None:
        dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        args, kw, target, _ = models.batch(model, size, step, int(os.environ.get("RANK", 0)), device, dtype)
        for name, took in zip(("forward", "backward", "step"), timed_step(engine, args, kw, target, sync)):
            phases.setdefault(name, []).append(took)

    for step in range(1, warmup + 1):  # warm-up, untimed
        one(step)
    phases.clear()
    for name in PHASES:
        _timed(engine.optimizer, name, phases, sync)
    first = warmup + 1  # the timed steps' numbers (their batches) follow the warm-up's
    if timers_only:
        fast_paths = z3guard.guard(engine).fast_paths if variant in GUARD_OPTIONS else []
        switch = _grad_offload_switch(engine.optimizer) if alternate else None
        halves: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
        for i, step in enumerate(range(first, first + steps)):
            on = i % 2 == 0 or switch is None  # without --alternate every step counts in one column
            if switch:
                switch(on)
            one(step)
            for name, took in phases.items():  # the timers keep appending to `phases`: emptied, not replaced
                halves[on].setdefault(name, []).extend(took)
            phases.clear()
        engine.destroy()
        z3guard.uninstall()
        runs = [(variant, True, steps)] if not switch else \
            [(f"{variant} grad_offload on", True, steps // 2), (f"{variant} grad_offload off", False, steps // 2)]
        return [{"variant": name, "offload": offload, "model": model, "steps": n, "warmup": warmup,
                 "fast_paths": fast_paths, "phases_ms": _medians(halves[on], n), "phases_s": halves[on]}
                for name, on, n in runs]
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for step in range(first, first + steps):
            one(step)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    phases_ms = _medians(phases, steps)
    python = cProfile.Profile()  # the Python functions of an unprofiled-by-torch step, after the phase timers
    with python:
        for step in range(first + steps, first + 2 * steps):
            one(step)
    text = io.StringIO()
    stats = pstats.Stats(python, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("tottime").print_stats("z3guard", 20)  # z3guard's own functions
    record = {"variant": variant, "offload": offload, "model": model, "steps": steps,
              "fast_paths": z3guard.guard(engine).fast_paths if variant in GUARD_OPTIONS else [],
              "cprofile": text.getvalue(),
              "phases_ms": phases_ms,
              "top_ops": [{"op": e.key, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                           "calls_per_step": e.count / steps} for e in ops]}
    engine.destroy()
    z3guard.uninstall()
    return [record]


def _grad_offload_switch(opt):
    """fast_grad_offload on or off between steps of one engine (`--alternate`)."""
    from z3guard.adapter import gradoffload

    try:
        return gradoffload.switch(opt)
    except ValueError as err:
        raise SystemExit(f"--alternate: {err}") from None


def _medians(phases: dict[str, list[float]], steps: int) -> dict[str, float]:
    """ms per step: the median call times the calls per step."""
    return {k: 1e3 * statistics.median(v) * (len(v) / steps) for k, v in phases.items()}


def main(offload: str = "param+optimizer", model: str = "gpt2", device: str = "cuda", steps: int = 3,
         variants: list[str] = typer.Option(["stock", "z3guard"]), warmup: int = 3,
         timers_only: bool = typer.Option(False, help="phase timers only: no torch.profiler, no cProfile"),
         alternate: bool = typer.Option(False, help="with --timers-only: fast_grad_offload on and off on "
                                                    "alternate steps of each engine, reported as two columns"),
         out: Path = typer.Option(None)) -> None:
    import deepspeed
    import torch.distributed as dist
    from rich.console import Console
    from rich.table import Table

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    records = [r for v in variants
               for r in profile(v, offload, model, steps, dev, dist.get_world_size(), warmup, timers_only, alternate)]
    if dist.get_rank() == 0:
        console = Console(width=150)
        t = Table(title=f"{model}, offload {offload}: ms per step (phase: median per call x calls per step)")
        t.add_column("phase")
        for r in records:
            t.add_column(r["variant"], justify="right")
        for name in ["forward", "backward", "step"] + PHASES:
            t.add_row(name, *(f"{r['phases_ms'][name]:.1f}" if name in r["phases_ms"] else "-" for r in records))
        console.print(t)
        for r in [r for r in records if "top_ops" in r]:
            o = Table(title=f"{r['variant']} {r['fast_paths']}: top ops by self CPU time")
            for col in ("op", "self CPU ms/step", "calls/step"):
                o.add_column(col)
            for e in r["top_ops"]:
                o.add_row(e["op"][:70], f"{e['self_cpu_ms_per_step']:.1f}", f"{e['calls_per_step']:.0f}")
            console.print(o)
            if os.environ.get("Z3GUARD_PRINT_CPROFILE"):
                print(r["cprofile"])
        out = out or ROOT / "results" / f"profile-{device}-{offload.replace('+', '-')}.json"
        out.write_text(json.dumps(records, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    typer.run(main)
    sys.stdout.flush()
    os._exit(0)
