"""`z3guard verify-resume`: the same job straight through and as save + resume in a fresh group,
compared bit for bit: losses, gathered fp32 and model weights, optimizer partitions, loss scaler,
learning rate, RNG streams and the saved data position."""
from __future__ import annotations

import math
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
    resume_ranks: int | None = None  # resume on this many ranks (default: nproc); see `_resharded`


@dataclass
class VerifyResult:
    identical: bool
    difference: Difference | None
    crash: dict | None  # a run that stopped on the failure under study (or a refused load)
    checked: list[str]
    seconds: float
    failure: dict | None = None  # a run that failed for another reason: no conclusion drawn
    losses: list[tuple[int, float, float]] = field(default_factory=list)  # resharded: (step, straight, resumed)
    tolerance: float | None = None  # resharded: the relative loss difference allowed (LOSS_TOLERANCE)

    @property
    def status(self) -> int:
        """0: bit-identical; 1: a difference, or a run stopped by a trace failure; 3: a run failed for
        another reason. (2, bad input, is refused before any run.)"""
        return 3 if self.failure else 0 if self.identical else 1

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "identical": self.identical, "checked": self.checked,
                "difference": None if self.difference is None else vars(self.difference),
                "crash": self.crash, "failure": self.failure, "seconds": round(self.seconds, 1),
                "losses": self.losses, "tolerance": self.tolerance}


def run(plan: VerifyPlan, on_progress: Callable[[str, int], None] | None = None) -> VerifyResult:
    shutil.rmtree(plan.out, ignore_errors=True)
    ckpt = str(plan.out / "checkpoint")
    n, m = plan.nproc, plan.resume_ranks or plan.nproc
    common = dict(scenario=plan.scenario, dtype=plan.dtype, guard=plan.guard, model=plan.model, batch=plan.batch,
                  loss=plan.loss, hidden=plan.hidden, config=plan.config, ds_config=plan.ds_config,
                  construct=plan.construct, skip_at=list(plan.skip_at))
    slots = math.lcm(n, m)  # on other rank counts: the same global batch, as micro-batch slots
    at_n = dict(global_batches=True, moments=True, grad_accum=slots // n) if m != n else {}
    first = run_jobs([Job("straight", steps=plan.steps, **common, **at_n),
                      Job("phase1", steps=plan.save_after, save_at=[plan.save_after], save_dir=ckpt, **common, **at_n)],
                     plan.out / "first", plan.device, n, on_progress=on_progress)
    for name in ("straight", "phase1"):
        if failure := first.failure(name):
            return VerifyResult(False, None, None, [], first.seconds, failure)
    at_m = dict(global_batches=True, moments=True, grad_accum=slots // m, state_after_load=True) if m != n else {}
    second = run_jobs([Job("resumed", steps=plan.steps, load_dir=ckpt, **common, **at_m)],
                      plan.out / "second", plan.device, m, on_progress=on_progress)
    seconds = first.seconds + second.seconds
    if failure := second.failure("resumed"):
        return VerifyResult(False, None, None, [], seconds, failure)
    straight = [first.result("straight", r) for r in range(n)]
    phase1 = first.result("phase1")
    resumed = [second.result("resumed", r) for r in range(m)]
    for res in (straight[0], phase1, resumed[0]):
        if res["crash"] or res.get("load_error"):
            return VerifyResult(False, None, res["crash"] or {"message": res["load_error"]}, [], seconds)
    if m != n:
        return _resharded(plan, straight, phase1, resumed, first, second, seconds)
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


# How far, relative to the loss, the losses after a resume on another number of ranks may stray from the
# uninterrupted run's over the steps a verify-resume runs: gradients are then summed over other ranks, in
# another order, so the last bits differ and grow with each step; fp16 and bf16 round more than fp32.
LOSS_TOLERANCE = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 5e-3}


def _resharded(plan, straight, phase1, resumed, first, second, seconds) -> VerifyResult:
    """Saved on N ranks, resumed on M: right after the load, the gathered fp32 master and model weights,
    both Adam moments of every parameter, buffers and the loss scale equal those at the save, bit for
    bit; the losses after it stay within LOSS_TOLERANCE of the uninterrupted run on N ranks (the same
    global batch); rank r < min(N, M) continues saved rank r's RNG streams exactly."""
    n, m = plan.nproc, plan.resume_ranks
    checked = [f"state right after the load on {m} ranks == at the save on {n}: gathered fp32 master and model "
               "weights, Adam moments, buffers"]
    diff = first_tensor_difference(first.state("phase1"), second.loaded("resumed"))
    tolerance = LOSS_TOLERANCE[plan.dtype]
    losses = [(int(k), straight[0]["global_losses"][k], v) for k, v in sorted(resumed[0]["global_losses"].items(),
                                                                                key=lambda kv: int(kv[0]))]
    if diff is None:
        checked.append("loss scale")
        if phase1["loss_scaler"]["scale"] != resumed[0]["loaded_scale"]:
            diff = Difference("loss scale", f"{resumed[0]['loaded_scale']} after the load != "
                                            f"{phase1['loss_scaler']['scale']} at the save")
    if diff is None:
        checked.append(f"global-batch losses of steps {plan.save_after + 1}-{plan.steps} within {tolerance:g} "
                       f"(relative) of the uninterrupted run on {n} ranks")
        for step, a, b in losses:
            if not abs(a - b) <= tolerance * abs(a):
                diff = Difference(f"loss@{step}", f"resumed {b!r} vs straight {a!r}: relative "
                                                  f"{abs(a - b) / abs(a):.2e} > {tolerance:g}")
                break
    for key, what in (("skipped", "skipped steps"), ("rng", f"RNG streams of ranks 0-{min(n, m) - 1}")):
        if diff is None:
            checked.append(what)
            for r in range(min(n, m) if key == "rng" else 1):
                a, b = straight[r][key], resumed[r][key]
                if key == "skipped":
                    a = [s for s in a if s > plan.save_after]
                if a != b:
                    diff = Difference(f"rank {r}: {what}", f"resumed {b!r} != straight {a!r}")
    if diff is None and plan.guard:
        checked.append(f"data position of every rank (saved rank r mod {n}'s)")
        for r in range(m):
            got = (resumed[r].get("data_position"), resumed[r].get("saved_rank"))
            if got != ({"next_step": plan.save_after + 1}, r % n):
                diff = Difference(f"rank {r}: data position", f"{got!r} != the save's, from saved rank {r % n}")
                break
    return VerifyResult(diff is None, diff, None, checked, seconds, losses=losses, tolerance=tolerance)
