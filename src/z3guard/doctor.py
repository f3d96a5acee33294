"""`z3guard doctor`: find what in a model will trip ZeRO-3, before a long run.

It trains the model a few steps under real DeepSpeed ZeRO-3 on CPU with z3guard watching (train steps,
an eval pass, a save), then resumes stock DeepSpeed from that checkpoint twice, once with a skipped step
and once with `GatheredParameters` between steps, and once from scratch, to show which hazard crashes
stock and on which event. `verify` resumes stock again with the suggested code changes applied.
"""
from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .diagnose import Names
from .scenarios.job import Job
from .scenarios.launch import run_jobs


@dataclass(frozen=True)
class DoctorPlan:
    scenario: str = "clip"
    model: str | None = None
    batch: str | None = None
    loss: str | None = None  # "pkg.module:function" (output, target) -> loss
    hf_path: str | None = None
    layers: int | None = None  # with hf_path: this many of its layers
    hidden: int = 512
    nproc: int = 2
    dtype: str = "fp16"
    ds_config: dict[str, Any] | None = None  # the user's DeepSpeed config; None: Hugging Face's ZeRO-3 example
    construct: str = "zero-init"  # as Hugging Face builds ZeRO-3 models; "plain": built, then handed over
    verify: bool = False
    out: Path = Path("runs/doctor")


@dataclass
class Hazard:
    kind: str  # cross-module read | read on some steps | order changes | runs more than once |
               # ranks run different modules
    module: str
    params: list[str] = field(default_factory=list)
    persistent: list[str] = field(default_factory=list)
    source: str | None = None
    crashes_stock_on: list[str] = field(default_factory=list)
    covered_by_z3guard: bool = True
    fix: list[str] = field(default_factory=list)


@dataclass
class Report:
    label: str
    hazards: list[Hazard]
    stock: dict[str, str]  # event -> "ok" or the crash's first line
    verified: bool | None
    z3guard_completed: bool
    module_counts: dict[str, int] = field(default_factory=dict)  # appearances per forward+backward trace
    failure: dict[str, Any] | None = None  # a run that failed for another reason: no conclusion drawn

    @property
    def status(self) -> int:
        """0: no hazards; 1: hazards (or stock crashed, or the guarded run did not complete); 3: a run
        failed for a reason other than a trace hazard. (2, bad input, is refused before any run.)"""
        if self.failure is not None:
            return 3
        clean = not self.hazards and set(self.stock.values()) <= {"ok"} and self.z3guard_completed
        return 0 if clean and self.verified is not False else 1

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.label, "status": self.status, "hazards": [asdict(h) for h in self.hazards],
                "stock": self.stock, "verified": self.verified, "z3guard_completed": self.z3guard_completed,
                "module_counts": self.module_counts, "failure": self.failure}


EVENTS = {"stock-skip": "resume + skipped step", "stock-gathered": "resume + GatheredParameters",
          "stock-fresh": "training from scratch"}


def run(plan: DoctorPlan, on_progress: Callable[[str, int], None] | None = None) -> Report:
    shutil.rmtree(plan.out, ignore_errors=True)
    ckpt = str(plan.out / "checkpoint")
    common = dict(scenario=plan.scenario, model=plan.model, batch=plan.batch, loss=plan.loss, hf_path=plan.hf_path,
                  layers=plan.layers, hidden=plan.hidden, dtype=plan.dtype, ds_config=plan.ds_config,
                  construct=plan.construct)
    label = plan.hf_path or (f"{plan.model}" if plan.model else plan.scenario)
    if plan.layers:
        label += f" ({plan.layers} layers)"
    # observed module by module, as stock ZeRO-3 fetches: a read inside a block fetched whole is a hazard still
    first = run_jobs([Job("observe", guard=True, steps=4, events={"2": ["eval"]}, save_at=[4], save_dir=ckpt,
                          options={"warn": False, "fast_block_fetch": False}, **common)],
                     plan.out / "observe", nproc=plan.nproc, on_progress=on_progress)
    if failure := first.failure("observe"):
        if failure.get("exception") == "RankDivergenceError":  # z3guard stopped the ranks: a hazard, named
            return Report(label, [_ranks_differ(failure)], {}, None, False)
        return Report(label, [], {}, None, False, failure=failure)
    seen = first.result("observe")
    pairs = sorted({(r["module"], r["param"]) for r in seen.get("reads", [])})
    stock = [Job("stock-skip", steps=7, skip_at=[6], load_dir=ckpt, **common),
             Job("stock-gathered", steps=7, events={"5": ["gathered"]}, load_dir=ckpt, **common),
             Job("stock-fresh", steps=6, events={"2": ["eval"]}, **common)]
    if plan.verify:
        register = [list(p) for p in pairs]
        stock += [Job("verify-skip", steps=7, skip_at=[6], load_dir=ckpt, register=register, **common),
                  Job("verify-gathered", steps=7, events={"5": ["gathered"]}, load_dir=ckpt, register=register,
                      **common)]
    second = run_jobs(stock, plan.out / "stock", nproc=plan.nproc, on_progress=on_progress)
    for job in stock:
        if failure := second.failure(job.name):
            return Report(label, [], {}, None, seen["crash"] is None, failure=failure)
    results = {j.name: second.result(j.name) for j in stock}
    outcome = {name: _outcome(r) for name, r in results.items()}
    hazards = _hazards(seen, pairs, {k: results[k].get("crash") for k in EVENTS})
    verified = None
    if plan.verify:
        verified = outcome["verify-skip"] == "ok" and outcome["verify-gathered"] == "ok"
    return Report(label, hazards, {EVENTS[k]: v for k, v in outcome.items() if k in EVENTS}, verified,
                  seen["crash"] is None and "load_error" not in seen, seen.get("module_counts", {}))


def _ranks_differ(failure: dict) -> Hazard:
    """The ranks ran different modules (a branch some ranks' batches take): nothing can make ZeRO-3 go on."""
    import re

    message = failure.get("message") or failure.get("summary") or ""
    found = re.search(r"rank \d+ (?:ran|read `[^`]+` in) `([^`]+)`", message)
    module = found.group(1) if found else "?"
    return Hazard("ranks run different modules", module, source=message, covered_by_z3guard=False,
                  fix=[f"run '{module}' on every rank on every step (a dummy input where a rank's batch does not "
                       "need it, as LLaVA trainers feed dummy images), or register a parameter read across modules "
                       "with deepspeed.zero.register_external_parameter"])


def _outcome(result: dict) -> str:
    crash = result.get("crash")
    return "ok" if crash is None else f"crashed at step {crash['step']}: {crash['summary']}"


def _crashed_on(crashes: dict[str, dict | None], module: str, params: list[str]) -> list[str]:
    """The events whose stock crash names this module or one of these parameters, or names neither."""
    def ours(crash: dict) -> bool:
        named = set(crash.get("params") or ())
        if crash.get("module") is None and not named:
            return True
        return crash.get("module") == module or bool(named & set(params))

    return [EVENTS[k] for k, c in crashes.items() if c is not None and ours(c)]


def _hazards(seen: dict, pairs: list[tuple[str, str]], crashes: dict[str, dict | None]) -> list[Hazard]:
    persistent = {r["param"] for r in seen.get("reads", []) if r["persistent"]}
    sources = {(r["module"], r["param"]): r["source"] for r in seen.get("reads", [])}
    pattern = {(r["module"], r["param"]): r for r in seen.get("read_pattern", [])}
    hazards: list[Hazard] = []
    by_module: dict[str, list[str]] = {}
    for module, param in pairs:
        by_module.setdefault(module, []).append(param)
    for module, params in by_module.items():
        fix = [f"deepspeed.zero.register_external_parameter({Names.attr_path(module)}, {Names.attr_path(p)})"
               for p in params]
        hazards.append(Hazard("cross-module read", module, params, sorted(set(params) & persistent),
                              sources.get((module, params[0])), _crashed_on(crashes, module, params), True, fix))
        some = [p for p in params if pattern.get((module, p), {}).get("steps", 0) < seen.get("forward_steps", 0)]
        if some:
            hazards.append(Hazard("read on some steps", module, some, sorted(set(some) & persistent),
                                  sources.get((module, some[0])), _crashed_on(crashes, module, some), True, fix))
    orders = {(d["module"], d["expected"]) for d in seen.get("divergences", []) if d["kind"] == "order"}
    for module, expected in sorted(orders):
        hazards.append(Hazard("order changes", module, [], [], None, [], True,
                              [f"make the order static around '{module}' (expected '{expected}'), or "
                               "deepspeed.utils.set_z3_leaf_modules(model, [<the varying module's class>])"]))
    for module, count in sorted(seen.get("module_counts", {}).items()):
        if count > 2 and module != "<root>":
            hazards.append(Hazard("runs more than once", module, [], [], None, [], True,
                                  [f"'{module}' appears {count} times in one forward+backward trace (2 is once): "
                                   "fine for ZeRO-3 if the count is the same every step"]))
    return hazards
