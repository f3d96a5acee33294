"""Save and load time of a large ZeRO-3 checkpoint: stock DeepSpeed against z3guard (staged, fsynced, block
hashes taken while writing; on load every size and every content hash verified before DeepSpeed reads).

    python bench/checkpoint_io.py --device cuda --nproc 1 --width 4096 --depth 13   # ~10.5 GB, bf16 + Adam
    python bench/checkpoint_io.py --width 512 --depth 2                              # CPU smoke (gloo, 2 ranks)

Each method saves twice and loads twice, in alternating order, each in a launch of its own started after
`sync`, so that no save waits on the write-back of the one before. The loads read files
the saves left in the page cache (as a resume right after a save does); a cold read from disk is slower for
both. Prints a table and writes bench/results/<name>.json.
"""
from __future__ import annotations

import os
import statistics
import sys
from datetime import date
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT.parent))

from bench.reshard import disk, machine, write_record  # noqa: E402
from z3guard.scenarios.job import Job  # noqa: E402
from z3guard.scenarios.launch import run_jobs  # noqa: E402

def model():
    """TinyLM blocks of 4 x width^2 parameters each; the shape comes from the launching command."""
    import os

    from z3guard.scenarios.models import TinyLM

    width, depth = map(int, os.environ.get("Z3GUARD_BENCH_SHAPE", "512x2").split("x"))
    return TinyLM(vocab=512, width=width, depth=depth)


def batch(step: int, micro: int, rank: int, dtype):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * micro + rank)
    tokens = torch.randint(0, 512, (2, 17), generator=g)
    return (tokens[:, :-1],), {"step": step}, tokens[:, 1:]


def main(device: str = typer.Option("cpu"), nproc: int = typer.Option(2), width: int = typer.Option(512),
         depth: int = typer.Option(2), out: Path = typer.Option(Path("runs/bench-checkpoint-io")),
         name: str = typer.Option(None, help="record name (default: <device>-checkpoint-io-<date>)")) -> None:
    import shutil

    console = Console()
    shutil.rmtree(out, ignore_errors=True)
    env = {"Z3GUARD_BENCH_SHAPE": f"{width}x{depth}"}
    common = dict(model="bench.checkpoint_io:model", batch="bench.checkpoint_io:batch", hidden=width, dtype="bf16",
                  construct="zero-init",
                  keep_state=False)
    dirs = {"stock": out / "stock", "z3guard": out / "z3guard"}
    save = lambda m, tag: Job(f"save-{m}-{tag}", guard=m == "z3guard", steps=1, save_at=[1], save_tag=tag,  # noqa
                              save_dir=str(dirs[m]), **common)
    load = lambda m, i: Job(f"load-{m}-{i}", guard=m == "z3guard", steps=1, load_dir=str(dirs[m]), **common)  # noqa
    saves = [save("stock", "r1"), save("z3guard", "r1"), save("z3guard", "r2"), save("stock", "r2")]
    loads = [load("stock", 1), load("z3guard", 1), load("z3guard", 2), load("stock", 2)]
    # each save and each load in a launch of its own, started once the disk has written back what the
    # last one left in the page cache (a process that loaded 10 GB also keeps much of it)
    launches = []
    for j in saves + loads:
        os.sync()
        launches.append(([j], run_jobs([j], out / j.name, device, nproc, timeout=3000, env=env)))
    results = {}
    for jobs, ran in launches:
        failed = next((f for f in map(ran.failure, [j.name for j in jobs]) if f), None)
        if ran.returncode != 0 or failed:
            console.print(f"failed: {failed['run']} ({failed['summary']})\n{failed['traceback']}" if failed else
                          ran.log[-4000:])
            raise typer.Exit(1)
        for j in jobs:
            results[j.name] = [ran.result(j.name, r) for r in range(nproc)]
    refused = [(name, res.get("save_error") or res.get("load_error")) for name, per_rank in results.items()
               for res in per_rank if res.get("save_error") or res.get("load_error")]
    if refused:
        console.print(f"refused: {refused[0]}")
        raise typer.Exit(1)
    times = {}
    for m in dirs:
        saved = [max(res["save_seconds"]["1"] for res in results[f"save-{m}-{t}"]) for t in ("r1", "r2")]
        loaded = [max(res["load_seconds"] for res in results[f"load-{m}-{i}"]) for i in (1, 2)]
        times[m] = {"save_s": [round(x, 3) for x in saved], "load_s": [round(x, 3) for x in loaded]}
    size = disk(dirs["stock"] / "r2")
    ratio = {k: statistics.mean(times["z3guard"][k]) / statistics.mean(times["stock"][k]) for k in ("save_s", "load_s")}
    import deepspeed
    import torch

    record = {"command": "python bench/checkpoint_io.py " + " ".join(sys.argv[1:]), "date": date.today().isoformat(),
              "machine": machine(device), "deepspeed": deepspeed.__version__, "torch": torch.__version__,
              "ranks": nproc, "device": device, "width": width, "depth": depth, "checkpoint_bytes": size,
              "times": times, "z3guard_over_stock": {k: round(v, 3) for k, v in ratio.items()}}
    table = Table(title=f"checkpoint of {size / 1e9:.2f} GB ({nproc} rank(s), {device}, bf16 + Adam): seconds, "
                        "two runs each")
    for col in ("", "stock DeepSpeed", "z3guard", "z3guard / stock"):
        table.add_column(col)
    for key, label in (("save_s", "save"), ("load_s", "load (z3guard: every hash verified)")):
        table.add_row(label, ", ".join(map(str, times["stock"][key])), ", ".join(map(str, times["z3guard"][key])),
                      f"{ratio[key]:.3f}")
    console.print(table)
    write_record(console, record, name or f"{device}-checkpoint-io-{record['date']}")


if __name__ == "__main__":
    typer.run(main)
