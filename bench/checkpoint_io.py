"""Save and load time of a large ZeRO-3 checkpoint: stock DeepSpeed against z3guard (staged, block hashes
taken while writing, published atomically, then synced to disk on a thread of its own; on load every size
and every content hash verified before DeepSpeed reads), and against z3guard with `durable_saves` (synced
before it is published).

    python bench/checkpoint_io.py --device cuda --nproc 1 --width 4096 --depth 13   # ~10.5 GB, bf16 + Adam
    python bench/checkpoint_io.py --width 512 --depth 2                              # CPU smoke (gloo, 2 ranks)

Each method saves and loads `--repeats` times (medians reported), the order alternating between rounds,
each in a launch of its own started after `sync`, so that no save waits on the write-back of the one
before; that write-back is timed too, as what a save leaves for the disk. The loads read files
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
         depth: int = typer.Option(2), repeats: int = typer.Option(3, help="saves and loads of each method"),
         loads: bool = typer.Option(True, help="also time the loads (durable_saves does not change them)"),
         out: Path = typer.Option(Path("runs/bench-checkpoint-io")),
         name: str = typer.Option(None, help="record name (default: <device>-checkpoint-io-<date>)")) -> None:
    import shutil
    import time

    console = Console()
    shutil.rmtree(out, ignore_errors=True)
    env = {"Z3GUARD_BENCH_SHAPE": f"{width}x{depth}"}
    common = dict(model="bench.checkpoint_io:model", batch="bench.checkpoint_io:batch", hidden=width, dtype="bf16",
                  construct="zero-init", keep_state=False)
    methods = ("stock", "z3guard", "z3guard-durable")
    dirs = {m: out / m for m in methods}
    options = {"stock": {}, "z3guard": {}, "z3guard-durable": {"durable_saves": True}}
    save = lambda m, i: Job(f"save-{m}-{i}", guard=m != "stock", steps=1, save_at=[1], save_tag=f"r{i}",  # noqa
                            save_dir=str(dirs[m]), options=options[m], **common)
    load = lambda m, i: Job(f"load-{m}-{i}", guard=m != "stock", steps=1, load_dir=str(dirs[m]), **common)  # noqa
    # rounds in alternating order (stock first, then stock last, ...), saves before loads
    order = [methods[::1 if i % 2 == 0 else -1] for i in range(repeats)]
    jobs = [save(m, i) for i, pair in enumerate(order) for m in pair] + \
           [load(m, i) for i, pair in enumerate(order) for m in pair if loads and m != "z3guard-durable"]
    # Each save and each load in a launch of its own, started once the disk has written back what the last
    # one left in the page cache; that write-back is timed too: it is the part of a save that stock leaves
    # to the kernel, z3guard's default syncs on a thread of its own (the process waits for it as it exits)
    # and z3guard with durable_saves waits for (fsync) before it publishes the checkpoint.
    rate = disk_write_rate(out, 4 << 30)
    results, writeback = {}, {}
    for j in jobs:
        if j.save_dir:  # one checkpoint per method on disk at a time (a 70B-size run would not fit three)
            shutil.rmtree(Path(j.save_dir) / f"r{int(j.save_tag[1:]) - 1}", ignore_errors=True)
        os.sync()
        ran = run_jobs([j], out / j.name, device, nproc, timeout=3000, env=env)
        began = time.perf_counter()
        os.sync()
        writeback[j.name] = time.perf_counter() - began
        failed = ran.failure(j.name)
        if ran.returncode != 0 or failed:
            console.print(f"failed: {failed['run']} ({failed['summary']})\n{failed['traceback']}" if failed else
                          ran.log[-4000:])
            raise typer.Exit(1)
        results[j.name] = [ran.result(j.name, r) for r in range(nproc)]
        refused = next((res.get("save_error") or res.get("load_error") for res in results[j.name]
                        if res.get("save_error") or res.get("load_error")), None)
        if refused:
            console.print(f"refused: {j.name}: {refused}")
            raise typer.Exit(1)
    times: dict[str, dict[str, list[float]]] = {}
    for m in dirs:
        saves = [results[f"save-{m}-{i}"] for i in range(repeats)]
        times[m] = {"save_s": [round(max(res["save_seconds"]["1"] for res in ranks), 3) for ranks in saves],
                    "writeback_after_save_s": [round(writeback[f"save-{m}-{i}"], 3) for i in range(repeats)]}
        if m == "z3guard":  # from the save's start until its background write-back had synced everything
            times[m]["on_disk_s"] = [round(max(res["durable_seconds"] for res in ranks), 3) for ranks in saves]
        if f"load-{m}-0" in results:
            times[m]["load_s"] = [round(max(res["load_seconds"] for res in results[f"load-{m}-{i}"]), 3)
                                  for i in range(repeats)]
    latest = dirs["z3guard"] / f"r{repeats - 1}"
    times["z3guard"]["verify_alone_s"] = verify_alone(latest, repeats)
    size = disk(dirs["stock"] / f"r{repeats - 1}")
    median = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    ratio = {k: median["z3guard"][k] / median["stock"][k] for k in ("save_s", "load_s") if k in median["stock"]}
    ratio["durable_save_s"] = median["z3guard-durable"]["save_s"] / median["stock"]["save_s"]
    stock_on_disk = median["stock"]["save_s"] + median["stock"]["writeback_after_save_s"]
    on_disk = {"z3guard": median["z3guard"]["on_disk_s"] / stock_on_disk,
               "z3guard-durable": (median["z3guard-durable"]["save_s"]
                                   + median["z3guard-durable"]["writeback_after_save_s"]) / stock_on_disk}
    import deepspeed
    import torch

    from z3guard.checkpoint import digest

    record = {"command": "python bench/checkpoint_io.py " + " ".join(sys.argv[1:]), "date": date.today().isoformat(),
              "machine": machine(device), "deepspeed": deepspeed.__version__, "torch": torch.__version__,
              "ranks": nproc, "device": device, "width": width, "depth": depth, "checkpoint_bytes": size,
              "hash_threads": digest.threads(), "disk_write_GBps": round(rate / 1e9, 3),
              "size_at_disk_rate_s": round(size / rate, 3), "order": [list(p) for p in order], "times": times,
              "median": {m: {k: round(v, 3) for k, v in t.items()} for m, t in median.items()},
              "z3guard_over_stock": {**{k: round(v, 3) for k, v in ratio.items()},
                                     **{f"on_disk_{m}": round(v, 3) for m, v in on_disk.items()}}}
    table = Table(title=f"checkpoint of {size / 1e9:.2f} GB ({nproc} rank(s), {device}, bf16 + Adam): seconds, "
                        f"{repeats} runs each, median")
    for col in ("", "stock DeepSpeed", "z3guard", "z3guard / stock", "z3guard durable_saves", "durable / stock"):
        table.add_column(col)

    def show(m: str, k: str) -> str:
        return f"{median[m][k]:.2f} (" + ", ".join(map(str, times[m][k])) + ")" if k in median[m] else ""

    table.add_row("save (the call)", show("stock", "save_s"), show("z3guard", "save_s"), f"{ratio['save_s']:.3f}",
                  show("z3guard-durable", "save_s"), f"{ratio['durable_save_s']:.3f}")
    table.add_row("write-back left after the process", show("stock", "writeback_after_save_s"),
                  show("z3guard", "writeback_after_save_s"), "", show("z3guard-durable", "writeback_after_save_s"), "")
    table.add_row("on disk after (stock: save + the write-back left)", f"{stock_on_disk:.2f}",
                  show("z3guard", "on_disk_s"), f"{on_disk['z3guard']:.3f}", "", f"{on_disk['z3guard-durable']:.3f}")
    table.add_row(f"its bytes written, then fdatasync'd once ({rate / 1e9:.2f} GB/s)", "", f"{size / rate:.2f}",
                  "", "", "")
    if "load_s" in ratio:
        table.add_row("load (z3guard: every block hash verified)", show("stock", "load_s"),
                      show("z3guard", "load_s"), f"{ratio['load_s']:.3f}", "", "")
    table.add_row("of which: hashes alone (z3guard check-checkpoint)", "", show("z3guard", "verify_alone_s"), "",
                  "", "")
    console.print(table)
    write_record(console, record, name or f"{device}-checkpoint-io-{record['date']}")


def disk_write_rate(folder: Path, size: int) -> float:
    """Bytes per second of `size` bytes written to `folder` (buffered, 64 MiB at a time) and then
    fdatasync'd: the disk's rate for a writer that syncs once at its end. A save that hands blocks to the
    disk while it goes on writing (as z3guard's does) overlaps the two and can beat size / rate."""
    import time

    folder.mkdir(parents=True, exist_ok=True)
    chunk, path = os.urandom(64 << 20), folder / "disk-probe"
    os.sync()
    began = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fdatasync(f.fileno())
    took = time.perf_counter() - began
    path.unlink()
    return size // len(chunk) * len(chunk) / took


def verify_alone(folder: Path, repeats: int) -> list[float]:
    """Seconds to verify `folder` (sizes and every block hash) in this process, the page cache warm as for
    the loads: what verification adds to a load on one rank."""
    import time

    from z3guard.checkpoint import manifest

    took = []
    for _ in range(repeats):
        began = time.perf_counter()
        manifest.verify(folder)
        took.append(round(time.perf_counter() - began, 3))
    return took


if __name__ == "__main__":
    typer.run(main)
