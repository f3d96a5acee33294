"""`z3guard verify-resume`: the same job straight through and as save + resume in a fresh group,
compared bit for bit: losses, gathered fp32 and model weights, optimizer partitions, loss scaler,
learning rate, RNG streams and the saved data position."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .compare import Difference, first_loss_difference, first_tensor_difference
from .job import Job
from .launch import run_jobs


@dataclass(frozen=True)
class VerifyPlan:
    scenario: str = "clip"
    dtype: str = "fp16"
    device: str = "cpu"
    nproc: int = 2
    steps: int = 8
    save_after: int = 4
    skip_at: tuple[int, ...] = (6,)
    guard: bool = True
    model: str | None = None
    batch: str | None = None
    hidden: int = 512
    out: Path = Path("runs/verify-resume")
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class VerifyResult:
    identical: bool
    difference: Difference | None
    crash: dict | None
    checked: list[str]
    seconds: float


def run(plan: VerifyPlan, on_progress: Callable[[str, int], None] | None = None) -> VerifyResult:
    shutil.rmtree(plan.out, ignore_errors=True)
    ckpt = str(plan.out / "checkpoint")
    common = dict(scenario=plan.scenario, dtype=plan.dtype, guard=plan.guard, model=plan.model, batch=plan.batch,
                  hidden=plan.hidden, config=plan.config, skip_at=list(plan.skip_at))
    first = run_jobs([Job("straight", steps=plan.steps, **common),
                      Job("phase1", steps=plan.save_after, save_at=[plan.save_after], save_dir=ckpt, **common)],
                     plan.out / "first", plan.device, plan.nproc, on_progress=on_progress)
    second = run_jobs([Job("resumed", steps=plan.steps, load_dir=ckpt, **common)],
                      plan.out / "second", plan.device, plan.nproc, on_progress=on_progress)
    seconds = first.seconds + second.seconds
    straight = [first.result("straight", r) for r in range(plan.nproc)]
    phase1 = first.result("phase1")
    resumed = [second.result("resumed", r) for r in range(plan.nproc)]
    for res in (straight[0], phase1, resumed[0]):
        if res["crash"] or res.get("load_error"):
            return VerifyResult(False, None, res["crash"] or {"message": res["load_error"]}, [], seconds)
    checked: list[str] = []
    diff = _first_difference(plan, straight, phase1, resumed, first, second, checked)
    return VerifyResult(diff is None, diff, None, checked, seconds)


def _first_difference(plan, straight, phase1, resumed, first, second, checked) -> Difference | None:
    losses = {**phase1["losses"], **resumed[0]["losses"]}
    checked.append(f"losses of steps 1-{plan.steps}")
    if d := first_loss_difference(straight[0]["losses"], losses):
        return d
    checked.append("gathered fp32 master and model weights")
    if d := first_tensor_difference(first.state("straight"), second.state("resumed")):
        return d
    for r in range(plan.nproc):
        checked.append(f"optimizer partition of rank {r}")
        if d := first_tensor_difference(first.optimizer("straight", r), second.optimizer("resumed", r)):
            return Difference(f"rank {r}: {d.where}", d.detail)
    for key, what in (("loss_scaler", "loss scale and hysteresis"), ("lr", "learning rate"),
                      ("rng", f"RNG streams (python, numpy, torch{', cuda' if plan.device == 'cuda' else ''})"),
                      ("skipped", "skipped steps")):
        checked.append(what)
        for r in range(plan.nproc):
            a, b = straight[r][key], resumed[r][key]
            if key == "skipped":
                a = [s for s in a if s > plan.save_after]
            if a != b:
                return Difference(f"rank {r}: {what}", f"resumed {b!r} != straight {a!r}")
    if plan.guard:
        checked.append("saved data position")
        want = {"next_step": plan.save_after + 1}
        if resumed[0].get("data_position") != want:
            return Difference("data position", f"resumed {resumed[0].get('data_position')!r} != {want!r}")
    return None
