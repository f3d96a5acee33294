"""What the CPU tests show, repeated on GPUs with NCCL (2 ranks, one GPU each).

    python bench/steady_state.py --device cuda --out /tmp/steady     # bench/gpu.sh runs it

1. bit-identity of the fast paths over 52 steps with 5 skipped steps, stock vs z3guard: no offload,
   offload_param only, and offload_param + offload_optimizer with DeepSpeedCPUAdam; with reads right
   after `step` (GatheredParameters, an eval forward, a checkpoint) and every gradient read and set
   through DeepSpeed's accessors; `--scenario tied` runs an LM of repeated blocks whose head reads the
   embedding's weight;
2. memory over 1,000 steps of the routed model (a new module order every step), z3guard.
Prints a table and writes <out>/steady_state.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from z3guard.scenarios import compare
from z3guard.scenarios.job import Job
from z3guard.scenarios.launch import run_jobs

SKIPS = [3, 10, 25, 26, 40]
# Reads right after `step` returned, in both runs of a pair.
EVENTS = {"5": ["gathered"], "11": ["eval"], "26": ["gathered"], "33": ["eval", "gathered"]}
# DeepSpeed's gradient accessors between backward and step and after it (safe_get_full_grad; halving them
# with safe_set_full_grad), where the fp32 gradients are cast on the host only when read (and reads after a
# step with none before it, which read the step's noted gradients).
GRADS = dict(grads={"2": ["before", "after"], "3": ["after"], "4": ["halve"], "5": ["after"], "12": ["before", "after"],
                    "25": ["before", "halve", "after"], "26": ["after"], "41": ["halve", "after"], "52": ["after"]})
PAIRS = {  # name -> config overrides of the HF ZeRO-3 example (offload of both, fp16)
    "no offload": {"zero_optimization": {"offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}},
    "offload_param": {"zero_optimization": {"offload_optimizer": {"device": "none"}}},
    "param+optimizer, DeepSpeedCPUAdam": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}},
}


def bit_identity(device: str, out: Path, options: dict | None = None, only: str = "",
                 control: bool = False, scenario: str = "clip", nproc: int = 2) -> list[dict]:
    """`options`: GuardOptions fields of the z3guard run; `only`: the pairs whose name contains it;
    `control`: stock against stock (is the stock run itself repeatable here?); `scenario`: the model
    ("tied": an LM of repeated blocks and a tied head; its blocks are larger than its largest module, so
    today's whole-block fetch leaves them per module)."""
    rows = []
    for i, (name, config) in enumerate(PAIRS.items()):
        if only not in name:
            continue
        common = dict(scenario=scenario, steps=52, skip_at=SKIPS, config=config, events=EVENTS, **GRADS)
        jobs = [Job(job, **common, guard=guard, options=(options or {}) if guard else {}, save_at=[20],
                    save_dir=str(out / f"pair{i}" / f"ckpt-{job}"))
                for job, guard in (("stock", False), ("z3guard", not control))]
        done = run_jobs(jobs, out / f"pair{i}", device, nproc=nproc)
        if done.returncode != 0:
            rows.append({"run": name, "error": done.log[-3000:]})
            continue
        stock, guarded = done.result("stock"), done.result("z3guard")
        diff = compare.first_job_difference(done, "stock", "z3guard", nproc=nproc)
        rows.append({"run": name, "steps": len(guarded["losses"]), "skipped": guarded["skipped"],
                     "stock_skipped": stock["skipped"], "fast_paths": guarded.get("fast_paths", []),
                     "overflow_reads": guarded.get("overflow_reads"), "grad_offload": guarded.get("grad_offload"),
                     "norm_graphs": guarded.get("norm_graphs"), "batched_grads": guarded.get("batched_grads"),
                     "first_difference": None if diff is None else str(diff)})
    return rows


def memory(device: str, out: Path, steps: int) -> dict:
    done = run_jobs([Job("long", scenario="moe", steps=steps, guard=True, track_memory=100)], out / "memory", device)
    if done.returncode != 0:
        return {"error": done.log[-3000:]}
    res = [done.result("long", r) for r in (0, 1)]
    return {"steps": steps, "trace": res[0]["trace"], "divergence_steps": [d["step"] for d in res[0]["divergences"]],
            **{f"rank{r}_{k}": res[r].get(k) for r in (0, 1) for k in ("rss", "gpu_allocated", "gpu_reserved")}}


def main(device: str = "cuda", out: Path = Path("/tmp/steady"),
         steps: int = typer.Option(1000, help="steps of the memory run; 0 skips it"),
         options: str = typer.Option("{}", help="GuardOptions fields of the z3guard runs, as JSON"),
         only: str = typer.Option("", help="only the pairs whose name contains this"),
         control: bool = typer.Option(False, help="stock against stock instead of z3guard"),
         scenario: str = typer.Option("clip", help="the model of the bit-identity pairs"),
         nproc: int = typer.Option(2, help="ranks of the bit-identity pairs (one GPU each); the memory run "
                                           "takes 2")) -> None:
    console = Console(width=160)
    out.mkdir(parents=True, exist_ok=True)
    rows = bit_identity(device, out, json.loads(options), only, control, scenario, nproc)
    mem = memory(device, out, steps) if steps else {}
    t = Table(title=f"fast paths vs stock, {scenario}, 52 steps, skipped {SKIPS} ({device})")
    for col in ("run", "fast paths", "skipped equal", "first difference"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["run"], ", ".join(r.get("fast_paths", [])), str(r.get("skipped") == r.get("stock_skipped")),
                  r.get("error", "")[-200:] or str(r["first_difference"] or "none: bit-identical"))
    console.print(t)
    m = Table(title=f"routed model, z3guard, {steps} steps ({device}): memory per rank, MiB")
    for col in ("step", "rank0 RSS", "rank1 RSS", "rank0 GPU alloc", "rank1 GPU alloc", "rank0 GPU reserved"):
        m.add_column(col, justify="right")
    mib = (lambda d, k: f"{d[k] / 2**20:.1f}" if d and k in d else "-")
    for step in sorted((mem.get("rank0_rss") or {}), key=int):
        m.add_row(step, mib(mem["rank0_rss"], step), mib(mem["rank1_rss"], step), mib(mem["rank0_gpu_allocated"], step),
                  mib(mem["rank1_gpu_allocated"], step), mib(mem["rank0_gpu_reserved"], step))
    if steps:
        console.print(m)
    console.print({k: mem.get(k) for k in ("trace", "divergence_steps", "error")})
    record = {"device": device, "bit_identity": rows, "memory": mem}
    (out / "steady_state.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    typer.run(main)
