"""The host side of one offload_optimizer step, in isolation: DeepSpeed's three passes (unscale,
DeepSpeedCPUAdam, cast into the fp16 partition) against z3guard's fused chunks, on one partition.

    python bench/fused_step.py --numel 177411584 --threads 16    # GPT-2 medium's partition per rank (2 ranks)

Alternates the two, prints the median ms of each and the ratio, writes bench/results/fused-step-<host>.json.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))


def main(numel: int = 177_411_584, threads: int = 0, repeats: int = 7,
         chunks: list[int] = typer.Option([1 << 18, 1 << 20, 1 << 22]), out: Path = typer.Option(None)) -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from threadpoolctl import threadpool_limits

    from z3guard.adapter.fusedstep import fused_update

    param = torch.nn.Parameter(torch.randn(numel))
    grad = torch.randn(numel)  # every timed call starts from these gradients (the unscale is in place)
    param.grad = grad.clone()
    low = torch.empty(numel, dtype=torch.float16)
    if torch.cuda.is_available():
        low = low.pin_memory()  # as offload_param keeps it
    adam = DeepSpeedCPUAdam([param], lr=1e-4)
    factor = 1. / torch.tensor(1024.0)
    limit = threadpool_limits(threads, user_api="openmp") if threads else None

    def three_passes() -> None:
        param.grad.mul_(factor)
        adam.step()
        low.copy_(param.data)

    def fused(chunk: int):
        def run() -> None:
            state = adam.state[param]
            state["step"] += 1
            fused_update(adam, adam.param_groups[0], state, param.data, param.grad, low, factor, chunk)
        return run

    variants = {"three passes (stock)": three_passes, **{f"fused, chunk {c}": fused(c) for c in chunks}}
    times: dict[str, list[float]] = {k: [] for k in variants}
    three_passes()  # allocates Adam's state
    for _ in range(repeats):
        for name, fn in variants.items():  # alternating, so drift hits all alike
            param.grad.copy_(grad)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if limit is not None:
        limit.restore_original_limits()
    base = statistics.median(times["three passes (stock)"])
    table = Table(title=f"{numel:,} fp32 elements, {threads or 'default'} OpenMP threads, median of {repeats}")
    for col in ("variant", "ms", "x stock"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    records = []
    for name, ts in times.items():
        med = statistics.median(ts)
        table.add_row(name, f"{med * 1e3:.1f}", f"{med / base:.3f}")
        records.append({"variant": name, "median_s": med, "times_s": ts})
    Console().print(table)
    out = out or ROOT / "results" / f"fused-step-{platform.node() or 'host'}.json"
    out.write_text(json.dumps({"numel": numel, "threads": threads, "cpus": os.cpu_count(), "records": records},
                              indent=1))


if __name__ == "__main__":
    typer.run(main)
