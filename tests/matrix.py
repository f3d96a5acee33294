"""The scenario matrix: each case as stock, guarded and a reference run.

Two launches run the whole matrix (fresh engines in the same ranks): phase 1 (train, save) with the
uninterrupted references, then the resumed/straight stock and guarded runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from z3guard.scenarios.job import Job

BIASES = [f"visual.attnpool.{p}_proj.bias" for p in ("c", "k", "q", "v")]


@dataclass(frozen=True)
class Case:
    id: str
    job: dict[str, Any] = field(default_factory=dict)  # scenario, dtype, config, grad_accum
    resume: bool = True  # phase 1 saves after step 4; stock and guarded resume from it
    skip_at: tuple[int, ...] = (6,)
    events: dict[str, list[str]] = field(default_factory=dict)
    steps: int = 9
    stock_crash_step: int | None = 7  # None: stock completes
    stock_message: str = "but got \n ()."  # in the message of stock's crash
    stock_fixed_in: str | None = None  # the first release where stock completes
    stock_params: tuple[str, ...] = tuple(BIASES)
    stock_module: str = "visual.attnpool"
    stock_differs: bool = False  # stock completes but its results differ from the reference
    # Stock hands a read the buffer of an all-gather still in flight: whether its contents are already
    # right is a race (on gloo the gather of a small tensor often wins), so the test asserts the read
    # itself, and bit-identity for the guarded run.
    stock_reads_inflight: bool = False
    reference: dict[str, Any] = field(default_factory=dict)  # what the reference changes: a known workaround


CLIP_CASES = [
    Case("resume-skip-fp16"),
    Case("resume-skip-bf16", {"dtype": "bf16"}),
    Case("skip-first-step-after-resume", skip_at=(5,), stock_crash_step=6),
    Case("gathered-parameters", skip_at=(), events={"6": ["gathered"]}),
    Case("partition-all", skip_at=(), events={"6": ["partition"]}),
    Case("eval-between-steps", events={str(s): ["eval"] for s in range(5, 10)}),
    Case("grad-accum-2", {"grad_accum": 2}),
    Case("ckpt-reentrant", {"scenario": "clip-ckpt-reentrant"}),
    Case("ckpt-non-reentrant", {"scenario": "clip-ckpt-non-reentrant"}),
    Case("offload-none", {"config": {"zero_optimization": {"offload_param": {"device": "none"},
                                                           "offload_optimizer": {"device": "none"}}}}),
    Case("prefetch-0", {"config": {"zero_optimization": {"stage3_prefetch_bucket_size": 0}}},
         stock_message="expected the next 9 parameters",
         stock_params=tuple(sorted(BIASES + [f"visual.attnpool.{p}_proj.weight" for p in "ckqv"]
                                   + ["visual.attnpool.positional_embedding"]))),
    Case("prefetch-large", {"config": {"zero_optimization": {"stage3_prefetch_bucket_size": 10**9}}}),
    # The workarounds users are given: each avoids the crash on stock DeepSpeed.
    Case("persistence-0", {"config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}},
         stock_crash_step=None),
    Case("workaround-register-external", {"preregister": True}, stock_crash_step=None),
    Case("workaround-leaf-module", {"scenario": "clip-leaf"}, stock_crash_step=None),
    Case("workaround-regather-after-skip", {"regather_after_skip": True}, stock_crash_step=None),
]
LM_CASES = [
    # The late read (steps 3, 6, 9) finds the weight partitioned: stock registers it mid-trace and
    # the head's backward fetch no longer matches the frozen trace.
    Case("read-on-some-steps", {"scenario": "side-read",
                                "config": {"zero_optimization": {"stage3_prefetch_bucket_size": 0}}},
         resume=False, skip_at=(), stock_crash_step=3, stock_module="head",
         stock_message="expected the next 2 parameters", stock_params=("blocks.0.fc1.weight", "embed.weight"),
         reference={"preregister": True}),
    # Same read, prefetch on: the weight is in flight (prefetched for blocks.0's backward) when the
    # head reads it; stock hands out the unfilled buffer, and the run silently goes wrong (NaN or
    # wrong loss at step 3, skipped steps after) whenever the read beats the gather.
    Case("read-while-prefetched", {"scenario": "side-read"}, resume=False, skip_at=(), stock_crash_step=None,
         stock_reads_inflight=True, reference={"preregister": True}),
    # The same read through the block's parameters(): stock hands out the weight in flight; z3guard waits for
    # it and leaves it unregistered (the workaround registers it: the same arithmetic).
    Case("parameters-read-while-prefetched", {"scenario": "parameters-read"}, resume=False, skip_at=(),
         stock_crash_step=None, stock_reads_inflight=True, reference={"preregister": True}),
    # The same read through named_parameters(), inside `GatheredParameters` over the block in the head's
    # forward: stock hands out the weight in flight and raises on leaving the context (with the read
    # registered by hand it frees the weight under the running head and raises too). The workaround: read
    # it plainly, registered by hand.
    Case("gathered-parameters-in-forward", {"scenario": "gathered-read"}, resume=False, skip_at=(), stock_crash_step=3,
         stock_message="Cannot partition a param in flight",
         reference={"scenario": "side-read", "preregister": True}),
    Case("tied-weight-read", {"scenario": "tied"}, resume=False, skip_at=(4,), stock_crash_step=None),
    Case("module-order-changes", {"scenario": "skip-block"}, resume=False, skip_at=(4,), stock_crash_step=None),
    # A block left out on step 4, after the trace has prefetched its weights: before 0.15.3 stock raises at
    # the step's end. The workaround: no prefetch (the same arithmetic).
    Case("prefetched-block-not-run", {"scenario": "skip-sometimes"}, resume=False, skip_at=(), stock_crash_step=4,
         stock_message="still have inflight params", stock_fixed_in="0.15.3",
         reference={"config": {"zero_optimization": {"stage3_prefetch_bucket_size": 0}}}),
]

RELEASE_CASES = {"resume-skip-fp16", "resume-skip-bf16", "gathered-parameters", "prefetched-block-not-run",
                 "gathered-parameters-in-forward"}
# The main suite's default: one case of each kind of trigger, workaround and read. Z3GUARD_MATRIX=full runs
# every case (when the crash fix or the adapter changes).
MAIN_CASES = {"resume-skip-fp16", "resume-skip-bf16", "skip-first-step-after-resume", "gathered-parameters",
              "eval-between-steps", "grad-accum-2", "ckpt-non-reentrant", "prefetch-0",
              "workaround-register-external", "read-on-some-steps", "read-while-prefetched", "module-order-changes",
              "parameters-read-while-prefetched", "gathered-parameters-in-forward", "prefetched-block-not-run"}
# What the releases of the scenario run in CI: the report's scenario, a block prefetched but not run, and
# GatheredParameters inside a forward.
FAST_RELEASE_CASES = {"resume-skip-fp16", "prefetched-block-not-run", "gathered-parameters-in-forward"}


def cases_for(release: str) -> list[Case]:
    """The main suite's cases (every case with Z3GUARD_MATRIX=full) in the main environment; in the release matrix (tests/releases.py) the report's
    scenario in fp16 and bf16 and the `GatheredParameters` trigger, or with `fast` the report's alone. Before 0.15 a bf16 step with
    non-finite gradients is applied, not skipped (every weight turns NaN), so there the bf16 case resumes
    without a forced overflow: stock completes, and z3guard must complete bit-identically too."""
    import os
    from dataclasses import replace

    from packaging.version import Version

    cases = CLIP_CASES + LM_CASES
    if os.environ.get("Z3GUARD_MATRIX") != "full":
        cases = [c for c in cases if c.id in MAIN_CASES]
    subset = {"1": RELEASE_CASES, "fast": FAST_RELEASE_CASES}.get(os.environ.get("Z3GUARD_RELEASE_MATRIX", ""))
    if subset:
        cases = [c for c in CLIP_CASES + LM_CASES if c.id in subset]
    if Version(release) < Version("0.15"):
        cases = [replace(c, stock_crash_step=None, skip_at=()) if c.job.get("dtype") == "bf16" else c
                 for c in cases if c.id in RELEASE_CASES | {"skip-first-step-after-resume", "partition-all"}]
    return [replace(c, stock_crash_step=None) if c.stock_fixed_in and Version(release) >= Version(c.stock_fixed_in)
            else c for c in cases]


def _release() -> str:
    from importlib.metadata import version

    return version("deepspeed")


CASES = cases_for(_release())


def phase1_jobs(cases: list[Case], root: Path) -> list[Job]:
    jobs = []
    for c in cases:
        if c.resume:
            jobs.append(Job(f"{c.id}-phase1", steps=4, save_at=[4], save_dir=str(root / c.id), **c.job))
        job = {**c.job, **c.reference}
        jobs.append(Job(f"{c.id}-reference", steps=c.steps, skip_at=list(c.skip_at), events=c.events, **job))
    return jobs


def phase2_jobs(cases: list[Case], root: Path) -> list[Job]:
    jobs = []
    for c in cases:
        common = dict(steps=c.steps, skip_at=list(c.skip_at), events=c.events,
                      load_dir=str(root / c.id) if c.resume else None, **c.job)
        jobs += [Job(f"{c.id}-guarded", guard=True, **common), Job(f"{c.id}-stock", **common)]
    return jobs
