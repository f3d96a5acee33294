"""Resume a ZeRO-3 checkpoint on another number of ranks: DeepSpeed's universal checkpoint (an offline
`ds_to_universal` conversion, then `"checkpoint": {"load_universal": true}`) against z3guard's direct load,
on the same checkpoint. Wall time, extra disk, and whether the state right after the load (gathered fp32
master and model weights, both Adam moments) equals the state at the save.

    python bench/reshard.py --save-ranks 2 --load-ranks 1                 # CPU (gloo) both ways
    python bench/reshard.py --save-ranks 2 --load-ranks 1 --device cuda   # saved on CPU ranks, loaded on a GPU

The checkpoint is saved by CPU ranks (gloo) in both cases, so that one GPU can load what several ranks
saved. Prints a table and writes bench/results/<name>.json.
"""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT.parent))

from z3guard.scenarios.compare import first_tensor_difference  # noqa: E402
from z3guard.scenarios.job import Job  # noqa: E402
from z3guard.scenarios.launch import rank_env, run_jobs  # noqa: E402

WIDTHS = {"small": (512, 4), "medium": (1024, 12)}  # (width, depth) of the TinyLM-shaped model


def model_small():
    from z3guard.scenarios.models import TinyLM

    return TinyLM(vocab=512, width=WIDTHS["small"][0], depth=WIDTHS["small"][1])


def model_medium():
    from z3guard.scenarios.models import TinyLM

    return TinyLM(vocab=512, width=WIDTHS["medium"][0], depth=WIDTHS["medium"][1])


def batch(step: int, micro: int, rank: int, dtype):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * micro + rank)
    tokens = torch.randint(0, 512, (4, 33), generator=g)
    return (tokens[:, :-1],), {"step": step}, tokens[:, 1:]


def machine(device: str) -> str:
    import os

    import torch

    cpu = f"{os.cpu_count()} CPU cores ({platform.machine()})"
    return f"1 x {torch.cuda.get_device_name(0)}, {cpu}" if device == "cuda" else cpu


def disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(save_ranks: int = typer.Option(2), load_ranks: int = typer.Option(1),
         device: str = typer.Option("cpu", help="where the loading ranks run: cpu or cuda"),
         size: str = typer.Option("small", help=", ".join(WIDTHS)),
         out: Path = typer.Option(Path("runs/bench-reshard")),
         name: str = typer.Option(None, help="record name (default: <device>-reshard-<date>)")) -> None:
    console = Console()
    shutil.rmtree(out, ignore_errors=True)
    width, _ = WIDTHS[size]
    common = dict(model=f"bench.reshard:model_{size}", batch="bench.reshard:batch", hidden=width, dtype="bf16",
                  moments=True)
    ckpt, universal = out / "checkpoint", out / "universal"
    saved = run_jobs([Job("save", guard=True, steps=2, save_at=[2], save_dir=str(ckpt), **common)],
                     out / "save", "cpu", save_ranks, timeout=3000)
    assert saved.returncode == 0, saved.log[-4000:]

    began = time.perf_counter()
    convert = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                              str(ckpt / "step2"), "--output_folder", str(universal / "step2")],
                             env=rank_env("cpu"), capture_output=True, text=True)
    convert_s = time.perf_counter() - began
    assert convert.returncode == 0, convert.stderr[-4000:]
    (universal / "latest_universal").write_text("step2")

    loads = [Job("z3guard", guard=True, steps=2, load_dir=str(ckpt), state_after_load=True, **common),
             Job("universal", steps=2, load_dir=str(universal), state_after_load=True,
                 config={"checkpoint": {"load_universal": True}}, **common)]
    loaded = run_jobs(loads, out / "load", device, load_ranks, timeout=3000)
    reference = saved.state("save")
    rows = []
    for job, extra_disk, convert_time in (("z3guard", 0, 0.0), ("universal", disk(universal), convert_s)):
        failure = loaded.failure(job)
        result = {} if failure else loaded.result(job)
        diff = None if failure else first_tensor_difference(reference, loaded.loaded(job))
        rows.append({"method": {"z3guard": "z3guard, direct load",
                                "universal": "ds_to_universal + load_universal"}[job],
                     "convert_s": round(convert_time, 2), "load_s": round(result.get("load_seconds", float("nan")), 2),
                     "extra_disk_bytes": extra_disk,
                     "state": (f"failed: {failure['summary']}" if failure else
                               "bit-identical to the save" if diff is None else f"differs: {diff}")})
    import deepspeed
    import torch

    record = {"command": "python bench/reshard.py " + " ".join(sys.argv[1:]), "date": date.today().isoformat(),
              "machine": machine(device), "deepspeed": deepspeed.__version__,
              "torch": torch.__version__, "save_ranks": save_ranks, "load_ranks": load_ranks, "model": size,
              "parameters": sum(v.numel() for k, v in reference.items() if k.startswith("master/")),
              "checkpoint_bytes": disk(ckpt), "rows": rows}
    table = Table(title=f"{size} model ({record['parameters']:,} parameters, checkpoint {record['checkpoint_bytes']:,} "
                        f"bytes): saved on {save_ranks} CPU ranks, loaded on {load_ranks} ({device})")
    for col in ("method", "convert s", "load s", "extra disk (bytes)", "state after the load"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["method"], f"{r['convert_s']:.1f}", f"{r['load_s']:.1f}", f"{r['extra_disk_bytes']:,}",
                      r["state"])
    console.print(table)
    write_record(console, record, name or f"{device}-reshard-{record['date']}")


def write_record(console: Console, record: dict, name: str) -> None:
    """bench/results/<name>.json, and where it went."""
    path = ROOT / "results" / f"{name}.json"
    path.write_text(json.dumps(record, indent=1))
    console.print(f"written: {path.relative_to(ROOT.parent)}")


if __name__ == "__main__":
    typer.run(main)
