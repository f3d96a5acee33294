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
    loss: str | None = None  # "pkg.module:function" (output, target) -> loss
    out: Path = Path("runs/verify-resume")
    config: dict[str, Any] = field(default_factory=dict)  # overrides of the job's config
    ds_config: dict[str, Any] | None = None  # the user's DeepSpeed config; None: Hugging Face's ZeRO-3 example
    construct: str = "zero-init"  # as Hugging Face builds ZeRO-3 models; "plain": built, then handed over


@dataclass
class VerifyResult:
    identical: bool
    difference: Difference | None
    crash: dict | None  # a run that stopped on the failure under study (or a refused load)
    checked: list[str]
    seconds: float
    failure: dict | None = None  # a run that failed for another reason: no conclusion drawn

    @property
    def status(self) -> int:
        """0: bit-identical; 1: a difference, or a run stopped by a trace failure; 3: a run failed for
        another reason. (2, bad input, is refused before any run.)"""
        return 3 if self.failure else 0 if self.identical else 1

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "identical": self.identical, "checked": self.checked,
                "difference": None if self.difference is None else vars(self.difference),
                "crash": self.crash, "failure": self.failure, "seconds": round(self.seconds, 1)}


def run(plan: VerifyPlan, on_progress: Callable[[str, int], None] | None = None) -> VerifyResult:
    shutil.rmtree(plan.out, ignore_errors=True)
    ckpt = str(plan.out / "checkpoint")
    common = dict(scenario=plan.scenario, dtype=plan.dtype, guard=plan.guard, model=plan.model, batch=plan.batch,
                  loss=plan.loss, hidden=plan.hidden, config=plan.config, ds_config=plan.ds_config,
                  construct=plan.construct, skip_at=list(plan.skip_at))
    first = run_jobs([Job("straight", steps=plan.steps, **common),
                      Job("phase1", steps=plan.save_after, save_at=[plan.save_after], save_dir=ckpt, **common)],
                     plan.out / "first", plan.device, plan.nproc, on_progress=on_progress)
    for name in ("straight", "phase1"):
        if failure := first.failure(name):
            return VerifyResult(False, None, None, [], first.seconds, failure)
    second = run_jobs([Job("resumed", steps=plan.steps, load_dir=ckpt, **common)],
                      plan.out / "second", plan.device, plan.nproc, on_progress=on_progress)
    seconds = first.seconds + second.seconds
    if failure := second.failure("resumed"):
        return VerifyResult(False, None, None, [], seconds, failure)
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
    checked.append("gathered fp32 master and model weights, buffers")
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
