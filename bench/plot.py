"""Plot bench/run.py records of the GPT-2 model: median step time per setting (offload) and variant.

    python bench/plot.py docs/benchmarks-cuda.png bench/results/h200x2-both-offloads-2026-11-30-*.json \
        bench/results/h200x2-param-offload-2026-11-30.json

Each bar is the median over the runs given of a variant's median step; each dot is one run's record.
Ratios belong to one run only (docs/benchmarks.md); the plot shows the spread between runs.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SETTINGS = {"param+optimizer": "offload_param + offload_optimizer\n(torchrun defaults)",
            "param": "offload_param", "none": "no offload"}
VARIANTS = {"stock": "stock DeepSpeed", "stock-persist0": "stock, persistence threshold 0",
            "stock-noprefetch": "stock, prefetch bucket 0", "z3guard-nofast": "z3guard, trace guard only",
            "z3guard-noblocks": "z3guard without the whole-block fetch", "z3guard": "z3guard (defaults)"}


def main(out: Path, results: list[Path]) -> None:
    records = [r for p in results for r in json.loads(p.read_text()) if r["model"] == "gpt2"]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    x, ticks, labelled = 0.0, [], set()
    for setting, name in SETTINGS.items():
        start = x
        for i, variant in enumerate(VARIANTS):
            ms = [r["median_step_s"] * 1e3 for r in records if (r["offload"], r["variant"]) == (setting, variant)]
            if not ms:
                continue
            mid = statistics.median(ms)
            ax.bar(x, mid, 0.8, color=f"C{i}", label=None if variant in labelled else VARIANTS[variant])
            labelled.add(variant)
            ax.plot([x + 0.25] * len(ms), ms, "k.", markersize=5)
            ax.annotate(f"{mid:.0f}", (x - 0.1, mid), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
            x += 1
        if x > start:
            ticks.append(((start + x - 1) / 2, name))
            x += 0.8
    ax.set_xticks([t for t, _ in ticks], [n for _, n in ticks])
    ax.set_ylabel("median step time, ms (lower is faster)")
    dates = sorted({r["date"] for r in records})
    machine = records[0].get("machine", f"{records[0]['gpus']} GPUs").split(" (")[0]
    ax.set_title(f"GPT-2-medium shape, ZeRO-3, {machine}, DeepSpeed {records[0]['deepspeed']}, "
                 f"{' to '.join(dict.fromkeys([dates[0], dates[-1]]))}\nbar: median over the runs; dot: one record",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=108)


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
