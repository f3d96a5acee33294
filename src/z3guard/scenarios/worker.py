"""Rank entry point: `torchrun ... -m z3guard.scenarios.worker SPEC.json` runs the spec's jobs in order."""
from __future__ import annotations

import datetime
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch


def allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 on CPUs without AVX512-FP16 although torch's kernels
    run; the reproduction (and only it) says yes so that the report's fp16 loss scaling is exercised."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        type(acc).is_fp16_supported = lambda self: True
        type(acc).supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]


def main(spec_path: str) -> int:
    import deepspeed
    import torch.distributed as dist

    from . import job as jobs
    from .failure import Crash

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    device = spec.get("device", "cpu")
    if device == "cpu":
        allow_fp16_on_cpu()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # a collective timeout of the caller's: a test that expects stock to hang need not wait 30 minutes
    timeout = os.environ.get("Z3GUARD_COLLECTIVE_TIMEOUT")
    limit = {"timeout": datetime.timedelta(seconds=float(timeout))} if timeout else {}
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", **limit)
    rank, world = dist.get_rank(), dist.get_world_size()
    progress = out / "progress.jsonl"

    def on_step(name: str, step: int) -> None:
        if rank == 0:
            with progress.open("a") as f:
                f.write(json.dumps({"job": name, "step": step}) + "\n")

    from z3guard.adapter import UnsupportedDeepSpeed

    for d in spec["jobs"]:
        job = jobs.Job.from_dict(d)
        try:
            _set_guard(job.guard, job.options)
        except UnsupportedDeepSpeed as exc:  # reported in the verdict; the stock jobs still run
            result = {"job": job.name, "unavailable": str(exc), "losses": {}, "skipped": [], "crash": None}
            (out / f"{job.name}.rank{rank}.json").write_text(json.dumps(result))
            on_step(job.name, -1)
            continue
        try:
            result = jobs.run(job, rank, world, on_step)
        except Exception as exc:  # while building the model or the engine, or loading: reported, then stop
            result = {"job": job.name, "losses": {}, "skipped": [], "fatal": True,
                      "crash": asdict(Crash.parse(0, exc))}
        state = result.pop("state", None)
        loaded = result.pop("loaded_state", None)
        if loaded is not None and rank == 0:
            torch.save(loaded, out / f"{job.name}.loaded.pt")
        optim = result.pop("optimizer", None)
        if state is not None and rank == 0:
            torch.save(state, out / f"{job.name}.state.pt")
        if optim is not None:
            torch.save(optim, out / f"{job.name}.optim.rank{rank}.pt")
        (out / f"{job.name}.rank{rank}.json").write_text(json.dumps(result, indent=1))
        on_step(job.name, -1)
        if result.get("fatal"):
            if (result.get("crash") or {}).get("exception") == "RankDivergenceError":
                _await_results(out, job.name, world)  # every rank raised it: let each report before ending
            return 1  # the launcher ends the other ranks; the jobs after this one do not run
    _set_guard(False)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _await_results(out: Path, job: str, world: int, seconds: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(list(out.glob(f"{job}.rank*.json"))) < world:
        time.sleep(0.1)


def _set_guard(on: bool, options: dict | None = None) -> None:
    import z3guard

    z3guard.uninstall()
    if on:
        # strict: a DeepSpeed z3guard cannot guard is reported in the verdict, not run as stock
        z3guard.install(z3guard.GuardOptions(**{"strict": True, **(options or {})}))


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: gloo/shm threads can abort there after a clean run
