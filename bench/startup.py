"""Start-up cost of the `Z3GUARD=1` hook for a process that never imports DeepSpeed (a launcher, a
data-loader or tokenizer worker): `python -c pass` with and without the variable, alternated, in an
environment where z3guard is installed as a wheel (`make test-wheel` builds one: .venv-wheel).

    python bench/startup.py [--python .venv-wheel/bin/python] [--runs 200]

Prints a table and writes bench/results/startup.json.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from datetime import date
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parent


def _once(python: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([python, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - start


def main(python: str = typer.Option(str(ROOT.parent / ".venv-wheel" / "bin" / "python")),
         runs: int = typer.Option(200, help="process starts per setting, alternated")) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("Z3GUARD")}
    settings = {"unset": base, "Z3GUARD=1": {**base, "Z3GUARD": "1"}}
    for env in settings.values():  # warm the page cache
        _once(python, env)
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(runs):
        for name, env in settings.items():
            times[name].append(_once(python, env))
    record = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "python": python, "runs": runs,
              **{name: {"median_ms": statistics.median(t) * 1e3, "p10_ms": sorted(t)[runs // 10] * 1e3,
                        "p90_ms": sorted(t)[runs * 9 // 10] * 1e3} for name, t in times.items()}}
    record["ratio_of_medians"] = record["Z3GUARD=1"]["median_ms"] / record["unset"]["median_ms"]
    print(f"{'setting':<10} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8}")
    for name in settings:
        r = record[name]
        print(f"{name:<10} {r['median_ms']:>10.2f} {r['p10_ms']:>8.2f} {r['p90_ms']:>8.2f}")
    print(f"Z3GUARD=1 / unset (medians): {record['ratio_of_medians']:.3f}")
    (ROOT / "results" / "startup.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    typer.run(main)
