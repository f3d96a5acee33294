"""Plot bench/results/<device>.json: median step time per model and variant (one bar group per model)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _call_number(call: str) -> int:
    """b2 before b10: calls in the order they ran."""
    digits = call.lstrip("b")
    return int(digits) if digits.isdigit() else -1


def main(results: Path, out: Path) -> None:
    records = json.loads(results.read_text())
    groups = sorted({(r["model"], r["offload"], r.get("call", "")) for r in records},
                    key=lambda g: (_call_number(g[2]), g[0], g[1]))
    variants = ["stock", "stock-persist0", "stock-noprefetch", "z3guard-nofast", "z3guard-noblocks", "z3guard"]
    fig, ax = plt.subplots(figsize=(14, 5.2))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs, ys = [], []
        for j, g in enumerate(groups):
            match = [r for r in records if (r["model"], r["offload"], r.get("call", "")) == g and r["variant"] == v]
            if match:
                xs.append(j + i * width)
                ys.append(match[0]["median_step_s"] * 1e3)
        ax.bar(xs, ys, width, label=v)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    short = {"param+optimizer": "p+o", "param": "param", "none": "none"}
    ax.set_xticklabels([f"{c} {m} {short.get(o, o)}" for m, o, c in groups], fontsize=8, rotation=40, ha="right")
    ax.set_ylabel("median step time (ms)")
    device = records[0]["device"]
    ax.set_title(f"ZeRO-3 step time by variant ({device}, DeepSpeed {records[0]['deepspeed']}); "
                 "ratios only within one call")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
