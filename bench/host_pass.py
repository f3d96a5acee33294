"""Why the fused host pass (unscale + DeepSpeedCPUAdam + cast, adapter/fusedstep.py) takes longer inside a
training step than alone (bench/fused_step.py).
Inside one training process of z3guard (offload_param + offload_optimizer), run by torchrun on every rank:

    torchrun --nproc_per_node 2 bench/host_pass.py --device cuda

1. timed steps with the pass split into its unscale, Adam and cast (summed over chunks);
2. a sweep of OpenMP threads x chunk size (`--sweep 16:1048576 --sweep 8:4194304 ...`), each for a few
   steps, twice in turn (so drift hits all alike): the step phase and the pass inside it;
3. after them, the pass again outside the step on the same buffers (both ranks at once, then rank 0
   alone), then on copies of them in ordinary (unpinned) memory; and what the process looks like
   (OpenMP runtimes and threads, CPU affinity, which buffers are pinned, the unscale factor's device).
Rank 0 prints a table and writes bench/results/host-pass-<device>.json (every rank's figures).
"""
from __future__ import annotations

import json
import os
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
from worker import config, make_engine, timed_step  # noqa: E402


def _split_pass(times: dict[str, float], seen: dict):
    """fusedstep.fused_update, each of its three parts timed (the same calls in the same order)."""
    from z3guard.adapter.fastpaths import cast_copy_

    def fused_update(adam, group, state, param, grad, low, factor, chunk_numel=1 << 20):
        seen.update(factor=str(getattr(factor, "device", type(factor).__name__)), low_pinned=low.is_pinned(),
                    param_pinned=param.is_pinned(), grad_pinned=grad.is_pinned(),
                    exp_avg_pinned=state["exp_avg"].is_pinned(), numel=param.numel())
        beta1, beta2 = group["betas"]
        param, grad, low = param.view(-1), grad.view(-1), low.view(-1)
        exp_avg, exp_avg_sq = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        for start in range(0, param.numel(), chunk_numel):
            chunk = slice(start, start + chunk_numel)
            t0 = time.perf_counter()
            grad[chunk].mul_(factor)
            t1 = time.perf_counter()
            adam.ds_opt_adam.adam_update(adam.opt_id, state["step"], group["lr"], beta1, beta2, group["eps"],
                                         group["weight_decay"], group["bias_correction"], param[chunk],
                                         grad[chunk], exp_avg[chunk], exp_avg_sq[chunk])
            t2 = time.perf_counter()
            cast_copy_(low[chunk], param[chunk])
            t3 = time.perf_counter()
            for k, d in (("unscale", t1 - t0), ("adam", t2 - t1), ("cast", t3 - t2)):
                times[k] = times.get(k, 0.0) + d
    return fused_update


def main(device: str = "cuda", warmup: int = 10, steps: int = 10, repeats: int = 5,
         sweep: list[str] = typer.Option([], help="threads:chunk_numel, run in turn"), sweep_steps: int = 5,
         out: Path = typer.Option(None)) -> None:
    import deepspeed
    import threadpoolctl
    import torch.distributed as dist

    import z3guard
    from z3guard.adapter import fusedstep

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    z3guard.install(z3guard.GuardOptions(warn=False))
    size = models.Size.of(device)
    cfg = config("z3guard", "param+optimizer", size.batch, world, device)
    if "optimizer" not in cfg:  # the CPU smoke run: DeepSpeedCPUAdam all the same
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    engine, size, sync = make_engine("gpt2", cfg, device)
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    opt = engine.optimizer

    def one(step: int) -> float:
        args, kw, target, _ = models.batch("gpt2", size, step, rank, dev, dtype)
        return timed_step(engine, args, kw, target, sync)[2]

    for step in range(1, warmup + 1):
        one(step)
    stock_update, parts, seen, per_step = fusedstep.fused_update, {}, {}, []
    fusedstep.fused_update = _split_pass(parts, seen)
    try:
        step_s = []
        for step in range(warmup + 1, warmup + 1 + steps):
            before = dict(parts)
            step_s.append(one(step))
            per_step.append({k: v - before.get(k, 0.0) for k, v in parts.items()})
    finally:
        fusedstep.fused_update = stock_update
    swept = _sweep(opt, fusedstep, stock_update, sweep, sweep_steps, one, warmup + 1 + steps) if sweep else {}
    record = {"rank": rank, "fast_paths": z3guard.guard(engine).fast_paths, "step_ms": 1e3 * statistics.median(step_s),
              "in_step_ms": {k: 1e3 * statistics.median(d[k] for d in per_step) for k in ("unscale", "adam", "cast")},
              "sweep": swept, **seen, "process_threads": len(os.listdir("/proc/self/task")),
              "affinity": len(os.sched_getaffinity(0)),
              "openmp": [{k: i.get(k) for k in ("filepath", "num_threads", "user_api")}
                         for i in threadpoolctl.threadpool_info()]}
    n = (getattr(opt, "z3guard_threads", None) or (None, 0))[1] or torch.get_num_threads()
    record["threads"] = n
    fp32 = opt.fp32_partitioned_groups_flat[0]
    adam = opt.optimizer
    group = adam.param_groups[opt.sub_group_to_group_id[0]]
    state = adam.state[fp32]
    real = (fp32.data, fp32.grad.data, opt.fp16_partitioned_groups_flat[0].data, state)
    copies = (fp32.data.clone(), fp32.grad.data.clone(), torch.empty_like(opt.fp16_partitioned_groups_flat[0].data),
              {"step": state["step"], "exp_avg": state["exp_avg"].clone(), "exp_avg_sq": state["exp_avg_sq"].clone()})
    factor = torch.tensor(1.0)  # CPU: leaves the gradients as they are
    with threadpoolctl.threadpool_limits(n, user_api="openmp"):
        for name, (param, grad, low, st) in (("real buffers", real), ("real buffers, rank 0 alone", real),
                                             ("unpinned copies", copies), ("real buffers again", real)):
            took = []
            for _ in range(repeats):
                dist.barrier()  # both ranks at once, as in the step
                t0 = time.perf_counter()
                if rank == 0 or "alone" not in name:
                    stock_update(adam, group, st, param, grad, low, factor)
                took.append(time.perf_counter() - t0)
                dist.barrier()
            record[f"outside_ms: {name}"] = 1e3 * statistics.median(took)
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="the fused host pass of one sub-group, ms (medians)")
        t.add_column("what")
        for r in records:
            t.add_column(f"rank {r['rank']}", justify="right")
        keys = ["step_ms", *(f"in_step_ms.{k}" for k in ("unscale", "adam", "cast")),
                *(k for k in records[0] if k.startswith("outside_ms")), "threads", "process_threads", "affinity",
                "factor", "param_pinned", "grad_pinned", "exp_avg_pinned", "low_pinned", "numel"]
        for k in keys:
            vals = [r["in_step_ms"][k.split(".")[1]] if k.startswith("in_step") else r.get(k) for r in records]
            t.add_row(k, *(f"{v:.1f}" if isinstance(v, float) else str(v) for v in vals))
        Console(width=150).print(t)
        if records[0]["sweep"]:
            w = Table(title="threads x chunk: ms per step (median over both turns; rank 0 / rank 1)")
            for col in ("threads:chunk", "step phase", "fused pass"):
                w.add_column(col, justify="right")
            for combo in records[0]["sweep"]:
                w.add_row(combo, *(" / ".join(f"{r['sweep'][combo][k]:.1f}" for r in records)
                                   for k in ("step_ms", "pass_ms")))
            Console(width=150).print(w)
        print(json.dumps(records[0]["openmp"], indent=1))
        out = out or ROOT / "results" / f"host-pass-{device}.json"
        out.write_text(json.dumps(records, indent=1))
    dist.barrier()
    engine.destroy()


def _sweep(opt, fusedstep, stock_update, combos: list[str], steps: int, one, first_step: int) -> dict:
    """Each threads:chunk combination for `steps` steps, all of them twice in turn; medians in ms."""
    from threadpoolctl import ThreadpoolController

    controller = getattr(opt, "z3guard_threads", (None, 0))[0] or ThreadpoolController()
    saved = getattr(opt, "z3guard_threads", None)  # fastpaths._step reads it at every step
    if "z3guard_stock_step" not in vars(opt):
        raise SystemExit("--sweep needs z3guard's step wrapper (the fused step)")
    took, step = {c: {"step": [], "pass": []} for c in combos}, first_step
    try:
        for _ in range(2):
            for combo in combos:
                threads, chunk = (int(x) for x in combo.split(":"))
                opt.z3guard_threads = (controller, threads)

                def timed_update(*args, _chunk=chunk, _into=took[combo]["pass"]):
                    t0 = time.perf_counter()
                    stock_update(*args, chunk_numel=_chunk)
                    _into.append(time.perf_counter() - t0)

                fusedstep.fused_update = timed_update
                for _ in range(steps):
                    took[combo]["step"].append(one(step))
                    step += 1
    finally:
        opt.z3guard_threads, fusedstep.fused_update = saved, stock_update
    return {c: {"step_ms": 1e3 * statistics.median(v["step"]), "pass_ms": 1e3 * statistics.median(v["pass"])}
            for c, v in took.items()}


if __name__ == "__main__":
    typer.run(main)
    sys.stdout.flush()
    os._exit(0)
