"""The report's scenario end to end: train, save, resume in a fresh group, skip a step, compare."""
from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .compare import first_loss_difference, first_tensor_difference
from .job import Job
from .launch import run_jobs


@dataclass(frozen=True)
class ReproPlan:
    scenario: str = "clip"
    dtype: str = "fp16"
    device: str = "cpu"
    nproc: int = 2
    save_after: int = 4
    skip_at: int = 6  # the skipped step, after the resume
    overflow: str = "forced"  # forced: the loss is made non-finite; natural: an outlier batch overflows fp16
    steps: int = 10
    out: Path = Path("runs/repro")
    config: dict[str, Any] = field(default_factory=dict)
    launcher: str = "torchrun"  # or "deepspeed": DeepSpeed's own launcher


@dataclass
class Row:
    run: str
    outcome: str  # completed | crashed | not available
    detail: str
    crash: dict | None = None
    matches_reference: bool | None = None


@dataclass
class Verdict:
    plan: dict[str, Any]
    rows: list[Row]
    as_expected: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan, "rows": [asdict(r) for r in self.rows], "as_expected": self.as_expected,
                "seconds": round(self.seconds, 1)}


def run(plan: ReproPlan, on_progress: Callable[[str, int], None] | None = None) -> Verdict:
    shutil.rmtree(plan.out, ignore_errors=True)
    ckpt = str(plan.out / "checkpoint")
    common = dict(scenario=plan.scenario, dtype=plan.dtype, config=plan.config)
    skip = {"skip_at": [plan.skip_at]} if plan.overflow == "forced" else {"spike_at": [plan.skip_at]}
    first = run_jobs([
        Job("phase1", steps=plan.save_after, save_at=[plan.save_after], save_dir=ckpt, **common),
        Job("reference", steps=plan.steps, **skip, **common),
    ], plan.out / "phase1", plan.device, plan.nproc, on_progress=on_progress, launcher=plan.launcher)
    # Phase 2 in a fresh process group: the guarded resume first, then stock (which is expected to crash).
    second = run_jobs([
        Job("guarded", steps=plan.steps, load_dir=ckpt, guard=True, **skip, **common),
        Job("stock", steps=plan.steps, load_dir=ckpt, **skip, **common),
    ], plan.out / "phase2", plan.device, plan.nproc, on_progress=on_progress, launcher=plan.launcher)

    ref = first.result("reference")
    if ref["crash"]:
        row = Row("reference (no interruption)", "crashed", ref["crash"]["summary"], crash=ref["crash"])
        return Verdict(_plan_dict(plan), [row], False, first.seconds + second.seconds)
    ref_state = first.state("reference")
    rows = [Row("reference (no interruption)", "completed",
                f"{len(ref['losses'])} steps, skipped {ref['skipped']}")]
    stock = second.result("stock")
    rows.append(_resumed_row("stock DeepSpeed, resumed", stock, ref, ref_state, second))
    guarded = second.result("guarded")
    rows.append(_resumed_row("z3guard, resumed", guarded, ref, ref_state, second))
    ok = rows[1].outcome == "crashed" and rows[2].outcome == "completed" and bool(rows[2].matches_reference)
    return Verdict(_plan_dict(plan), rows, ok, first.seconds + second.seconds)


def _plan_dict(plan: ReproPlan) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(plan).items()}


def _resumed_row(label: str, result: dict, ref: dict, ref_state, launch) -> Row:
    if result.get("unavailable"):
        return Row(label, "not available", result["unavailable"])
    if result["crash"]:
        c = result["crash"]
        detail = f"step {c['step']}: {c['summary']}; module {c['module']}; parameters {', '.join(c['params'])}"
        return Row(label, "crashed", detail, crash=c)
    loss_diff = first_loss_difference(ref["losses"], result["losses"])
    state_diff = first_tensor_difference(ref_state, launch.state(result["job"]))
    same = loss_diff is None and state_diff is None
    n = len(result["losses"])
    detail = (f"steps {result['start'] + 1}-{result['start'] + n}, skipped {result['skipped']}; "
              + ("losses and final weights bit-identical to the reference" if same
                 else f"differs from the reference: {loss_diff or state_diff}"))
    return Row(label, "completed", detail, matches_reference=same)
