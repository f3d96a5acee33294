"""Benchmark stock DeepSpeed ZeRO-3, its workarounds and z3guard side by side, in one process group.
Baselines beside them: stock-tuned (stock with this rank's share of the cores as its threads), fsdp2
(PyTorch FSDP2, bf16; fsdp2-tuned with the threads of stock-tuned), and stock-bf16 / z3guard-bf16 to
compare with it at equal precision. Every record names its precision and threads.

    python bench/run.py --device cpu           # small sizes: a smoke run (CI)
    python bench/run.py --device cuda          # GPT-2-medium shape on 2 GPUs: the numbers that count
    python bench/run.py --device cuda --isolate --run gpt2:stock:param+optimizer ...
                                               # one process group per run: peak host memory per run

Prints a table and writes bench/results/<device>.json (a list of records, one per model/variant/offload).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from z3guard.scenarios.launch import run_ranks  # noqa: E402

MODELS = ["gpt2", "gpt2-skip", "gpt2-moe", "clip"]
VARIANTS = ["stock", "stock-persist0", "stock-noprefetch", "z3guard", "z3guard-nofast"]
# The offload configurations, stock against z3guard, on the static GPT-2 shape.
OFFLOAD_RUNS = [("gpt2", "stock", "none"), ("gpt2", "stock", "param+optimizer"),
                ("gpt2", "z3guard", "param+optimizer")]


def applicable(runs: list[dict], console: Console) -> list[dict]:
    """The runs that exist: FSDP2 has no parameter-only offload (its CPUOffloadPolicy moves parameters,
    gradients and the optimizer step together), so fsdp2 with `param` is skipped, with a note."""
    skipped = [r for r in runs if r["variant"].startswith("fsdp2") and r["offload"] == "param"]
    for r in skipped:
        console.print(f"[yellow]skipped {r['model']}:{r['variant']}:param: not applicable, FSDP2 has no "
                      f"parameter-only offload (CPUOffloadPolicy offloads parameters, gradients and the "
                      f"optimizer step together: see {r['model']}:{r['variant']}:param+optimizer)[/]")
    return [r for r in runs if r not in skipped]


def plan(models: list[str], variants: list[str], offload_runs: bool) -> list[dict]:
    runs = [{"model": m, "variant": v, "offload": "param"} for m in models for v in variants]
    if offload_runs:
        runs += [{"model": m, "variant": v, "offload": o} for m, v, o in OFFLOAD_RUNS if m in models]
    return runs


def table(records: list[dict]) -> Table:
    isolated = all(r.get("isolated") for r in records)
    groups = "a process group per run" if isolated else "one process group"
    t = Table(title=f"ZeRO-3 step time, side by side ({groups})")
    host = "host peak GiB" if isolated else "host RSS GiB"  # one process for all runs: RSS only grows
    for col in ("model", "offload", "variant", "dtype / thr", "median ms", "fwd / bwd / step ms", "x stock", "tokens/s",
                "MFU", "peak GPU GiB", host, "invalidations", "switches"):
        t.add_column(col, justify="right" if col not in ("model", "offload", "variant") else "left")
    for r, base in zip(records, _stock_medians(records)):
        gib = (lambda b: f"{b / 2**30:.2f}" if b else "-")
        split = " / ".join(f"{v * 1e3:.0f}" for v in r.get("phase_median_s", {}).values()) or "-"
        t.add_row(r["model"], r["offload"], r["variant"], f"{r.get('precision', '-')} / {r.get('threads', '-')}",
                  f"{r['median_step_s'] * 1e3:.1f}", split,
                  f"{r['median_step_s'] / base:.3f}" if base else "-", f"{r['tokens_per_s']:.0f}",
                  f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-",
                  gib(r["peak_gpu_mem_bytes"]), gib(r["host_peak_rss_bytes" if isolated else "host_rss_bytes"]),
                  *("-" if r[k] is None else str(r[k]) for k in ("invalidations", "trace_switches")))
    return t


def _stock_medians(records: list[dict]) -> list[float | None]:
    """Each record's stock reference: the last stock run of its model and offload before it (runs may
    alternate stock and z3guard to give several side-by-side pairs), else the first one after it."""
    first = {}
    for r in records:
        if r["variant"] == "stock":
            first.setdefault((r["model"], r["offload"]), r["median_step_s"])
    last, out = dict(first), []
    for r in records:
        key = (r["model"], r["offload"])
        if r["variant"] == "stock":
            last[key] = r["median_step_s"]
        out.append(last.get(key))
    return out


def main(device: str = typer.Option("cpu", help="cpu (smoke) or cuda"), nproc: int = typer.Option(2),
         models: list[str] = typer.Option(MODELS), variants: list[str] = typer.Option(VARIANTS),
         offload_runs: bool = typer.Option(True, help="add the offload configurations"),
         run: list[str] = typer.Option([], help="explicit runs model:variant:offload (repeatable); "
                                                "replaces the plan from --models/--variants"),
         isolate: bool = typer.Option(False, help="one process group per run (so each run's peak host "
                                                  "memory is its own), in the order given"),
         steps: int = typer.Option(20, help="timed steps per run (after warm-up)"),
         warmup: int = typer.Option(5), timeout: int = typer.Option(3000),
         out: Path = typer.Option(None, help="default bench/results/<device>.json")) -> None:
    console = Console(width=170)
    runs = ([dict(zip(("model", "variant", "offload"), r.split(":"))) for r in run] if run
            else plan(models, variants, offload_runs))
    runs = applicable(runs, console)
    work = Path(tempfile.mkdtemp(prefix="z3guard-bench-"))
    command = "python bench/run.py " + " ".join(sys.argv[1:])  # in each record: what made it
    groups = [[r] for r in runs] if isolate else [runs]
    console.print(f"{len(runs)} runs, {warmup} warm-up + {steps} timed steps each, {nproc} ranks on {device}, "
                  f"{len(groups)} process group(s)")
    records, failed = [], False
    for i, group in enumerate(groups):
        with console.status(f"benchmarking (process group {i + 1} of {len(groups)})..."):
            done, ok = _run_group(group, work / f"group-{i:02d}", device, nproc, warmup, steps, timeout, console)
        records += [{**json.loads(p.read_text()), "isolated": isolate, "command": command}
                    for p in sorted((work / f"group-{i:02d}").glob("record-*.json"))]
        if not ok and done is not None:
            console.print(done.log[-6000:])
        failed |= not ok
        if records:  # after every group: a run cut short still leaves what ran before it
            out = out or ROOT / "results" / f"{device}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(records, indent=1))
    if records:
        console.print(table(records))
        console.print(f"wrote {out}: {len(records)} of {len(runs)} runs")
    if failed or len(records) != len(runs):
        raise typer.Exit(1)


def _run_group(runs: list[dict], work: Path, device: str, nproc: int, warmup: int, steps: int, timeout: int,
               console: Console):
    """One process group runs `runs` in turn; returns (the launch, whether it succeeded)."""
    from z3guard.scenarios.launch import LaunchError

    work.mkdir(parents=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"device": device, "out": str(work), "warmup": warmup, "steps": steps, "runs": runs}))
    try:
        done = run_ranks([str(ROOT / "worker.py"), str(spec)], work, device, nproc, timeout)
        return done, done.returncode == 0
    except LaunchError as exc:  # past --timeout: keep the runs that finished
        console.print(f"[red]{exc}[/]")
        return None, False


if __name__ == "__main__":
    typer.run(main)
