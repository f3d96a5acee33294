"""`z3guard.install()` is all a Trainer or accelerate user adds (real Trainer/accelerate,
real DeepSpeed ZeRO-3 with CPU offload, 2 gloo ranks): stock crashes after resume + skipped step,
guarded completes with the uninterrupted run's losses, and its checkpoint carries a manifest."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from z3guard.checkpoint import manifest
from z3guard.scenarios.launch import run_ranks

from .conftest import LAUNCH_TIMEOUT

SCRIPTS = Path(__file__).parent / "scripts"
FRAMEWORKS = {
    "trainer": ("hf_trainer_resume.py", "resumed-guarded/checkpoint-4/global_step4"),
    "accelerate": ("accelerate_resume.py", "state-guarded/pytorch_model"),
}


@pytest.fixture(scope="module", params=list(FRAMEWORKS))
def framework(request, runs):
    script, ckpt = FRAMEWORKS[request.param]
    out = runs / request.param
    results = {}
    for phase, guard in [("straight", False), ("first", False), ("resume", False), ("first", True),
                         ("resume", True)]:
        argv = [str(SCRIPTS / script), str(out), "--phase", phase] + (["--guard"] if guard else [])
        done = run_ranks(argv, out / f"launch-{phase}-{guard}", timeout=LAUNCH_TIMEOUT)
        assert done.returncode == 0, done.log[-5000:]
        name = f"{phase}{'-guarded' if guard else ''}"
        results[name] = json.loads((out / f"{name}.json").read_text())
    return request.param, out / ckpt, results


def test_stock_crashes_after_resume(framework):
    _, _, results = framework
    crash = results["resume"]["crash"]
    assert crash and crash.startswith("tracing error") and "expected the next 4 parameters" in crash
    assert "visual.attnpool.q_proj.bias" in crash


def test_guarded_resume_logs_the_uninterrupted_losses(framework):
    _, _, results = framework
    guarded, straight = results["resume-guarded"], results["straight"]
    assert guarded["crash"] is None
    resumed_steps = [s for s in guarded["losses"] if int(s) > 4]
    assert resumed_steps == ["5", "6", "7", "8"]
    assert {s: guarded["losses"][s] for s in resumed_steps} == {s: straight["losses"][s] for s in resumed_steps}


def test_the_frameworks_save_went_through_the_atomic_path(framework):
    _, ckpt, _ = framework
    m = manifest.verify(ckpt, world_size=2, zero_stage=3, dtype="bf16")
    assert m.global_step == 4
