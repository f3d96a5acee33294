"""The soak: a long guarded run on CPU with every hazard at once (a nightly-size run, not in CI).

    python tests/soak.py [--steps 1000] [--every 100] [--out soak-out]

2 gloo ranks train the `rank-read` model (its head reads a persistent bias of another module when the
rank's own batch says so: reads that differ between ranks) in bf16 (under a forced skip every fifty steps
fp16's loss scale reaches its minimum and DeepSpeed ends the run) for `--steps` steps, as segments of
`--every` steps in one process group: each segment resumes from the checkpoint the previous one saved
(a fresh engine, as a requeued job builds). Seeded random skipped steps (2%), an evaluation forward, a
forward of the module outside the engine (as generate() runs) and a `GatheredParameters` between steps.
Passes when no rank crashed or hung, every segment resumed where the last one saved, and host memory
was flat: the resident size after the last segment within 5% of the one after the second (the first
builds DeepSpeed's caches).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from z3guard.scenarios.job import Job  # noqa: E402
from z3guard.scenarios.launch import LaunchError, run_jobs  # noqa: E402

EVENTS = ("eval", "module-forward", "gathered")


def segments(steps: int, every: int, out: Path, seed: int = 7) -> list[Job]:
    rng = random.Random(seed)
    jobs, load = [], None
    for end in range(every, steps + 1, every):
        start = end - every
        skips = sorted(s for s in range(start + 1, end + 1) if rng.random() < 0.02)
        events = {str(s): [rng.choice(EVENTS)] for s in range(start + 1, end + 1) if rng.random() < 0.1}
        jobs.append(Job(f"seg{end}", guard=True, scenario="rank-read", dtype="bf16", steps=end, skip_at=skips,
                        events=events, save_at=[end], save_dir=str(out / "ckpt"), load_dir=load, track_memory=every,
                        keep_state=False))
        load = str(out / "ckpt")
    return jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("soak-out"))
    args = parser.parse_args()
    if args.steps % args.every or args.steps < 3 * args.every:
        parser.error("--steps must be a multiple of --every, at least 3 segments")
    jobs = segments(args.steps, args.every, args.out)
    try:
        done = run_jobs(jobs, args.out / "runs", timeout=30 * len(jobs) + 300)
    except LaunchError as exc:
        print(f"FAILED: hung ({exc})")
        return 1
    problems, rss, skipped = [], {}, 0
    for job in jobs:
        for rank in (0, 1):
            try:
                res = done.result(job.name, rank)
            except LaunchError as exc:
                problems.append(f"{job.name} rank {rank}: no result ({str(exc).splitlines()[0]})")
                continue
            if res["crash"] is not None or res.get("load_error"):
                problems.append(f"{job.name} rank {rank}: {res['crash'] or res['load_error']}")
            expected = job.steps - args.every
            if res.get("start") != expected:
                problems.append(f"{job.name} rank {rank}: resumed at step {res.get('start')}, expected {expected}")
            if rank == 0:
                rss[job.name] = max(res.get("rss", {}).values(), default=0)
                skipped += len(res["skipped"])
    first, last = rss.get(jobs[1].name, 0), rss.get(jobs[-1].name, 0)
    growth = (last - first) / first if first else float("inf")
    if growth > 0.05:
        problems.append(f"host memory grew {growth:+.1%} from {jobs[1].name} to {jobs[-1].name}")
    summary = {"steps": args.steps, "segments": len(jobs), "skipped_steps": skipped, "seconds": round(done.seconds, 1),
               "rss_mib": {k: round(v / 2**20, 1) for k, v in rss.items()}, "rss_growth": round(growth, 4),
               "problems": problems}
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    print("FAILED" if problems else "passed", f"({args.out / 'soak.json'})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
