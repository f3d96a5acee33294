"""`z3guard.install()` is all a Trainer or accelerate user adds (real Trainer/accelerate,
real DeepSpeed ZeRO-3 with CPU offload, 2 gloo ranks): stock crashes after resume + skipped step,
guarded completes with the uninterrupted run's losses, and its checkpoint carries a manifest."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from z3guard.checkpoint import manifest
from z3guard.scenarios.launch import run_ranks

from .conftest import LAUNCH_TIMEOUT

SCRIPTS = Path(__file__).parent / "scripts"
SAVED = {"trainer": "resumed-guarded", "accelerate": "state-guarded"}  # where the guarded first phase saves
FRAMEWORKS = {
    "trainer": ("hf_trainer_resume.py", "resumed-guarded/checkpoint-4/global_step4"),
    "accelerate": ("accelerate_resume.py", "state-guarded/pytorch_model"),
}


@pytest.fixture(scope="module", params=list(FRAMEWORKS))
def framework(request, runs):
    script, ckpt = FRAMEWORKS[request.param]
    out = runs / request.param
    results = {}
    # Stock resumes from the guarded save (a z3guard checkpoint is DeepSpeed's own layout): the crash comes
    # from the resume and the skipped step, whoever saved.
    for phase, guard in [("straight", False), ("first", True), ("resume", False), ("resume", True)]:
        if (phase, guard) == ("resume", False):
            shutil.copytree(out / SAVED[request.param], out / SAVED[request.param].replace("-guarded", ""))
        argv = [str(SCRIPTS / script), str(out), "--phase", phase] + (["--guard"] if guard else [])
        done = run_ranks(argv, out / f"launch-{phase}-{guard}", timeout=LAUNCH_TIMEOUT)
        assert done.returncode == 0, done.log[-5000:]
        name = f"{phase}{'-guarded' if guard else ''}"
        results[name] = json.loads((out / f"{name}.json").read_text())
    return request.param, out / ckpt, results


def framework_out(framework) -> Path:
    """The folder the framework's runs wrote into."""
    _, ckpt, _ = framework
    return next(p for p in ckpt.parents if p.name in FRAMEWORKS)


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


def test_a_checkpoint_saved_on_2_ranks_resumes_on_1(framework, tmp_path):
    """Trainer's `resume_from_checkpoint` and accelerate's `load_state` on 1 rank, of the guarded checkpoint
    saved on 2: z3guard re-partitions it. Trainer (gradient accumulation 2: the same 8 samples a step) logs
    losses within verify-resume's tolerance of the uninterrupted run on 2 ranks; accelerate's first step
    after the load, on rank 0's batch, gives rank 0's loss of that run bit for bit."""
    from z3guard.scenarios.verify import LOSS_TOLERANCE

    name, _, results = framework
    saved = SAVED[name]
    # the checkpoint of step 4 alone (the guarded resume went on to save step 8 there too)
    shutil.copytree(framework_out(framework) / saved, tmp_path / saved, ignore=shutil.ignore_patterns("checkpoint-8"))
    argv = [str(SCRIPTS / FRAMEWORKS[name][0]), str(tmp_path), "--phase", "resume", "--guard", "--grad-accum", "2"]
    done = run_ranks(argv, tmp_path / "launch", nproc=1, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.log[-5000:]
    assert "saved on 2 ranks; re-partitioning it for 1" in done.log
    resumed, straight = json.loads((tmp_path / "resume-guarded.json").read_text()), results["straight"]
    assert resumed["crash"] is None  # Trainer's log keeps steps 1-4 from its saved state: the resumed are 5-8
    assert sorted((s for s in resumed["losses"] if int(s) > 4), key=int) == ["5", "6", "7", "8"]
    assert "global_step4 was saved on 2 ranks" in done.log or name == "accelerate"
    if name == "accelerate":
        assert resumed["losses"]["5"] == straight["losses"]["5"]
        return
    for step in ("5", "6", "7", "8"):
        a, b = straight["losses"][step], resumed["losses"][step]
        assert a == b or abs(a - b) <= LOSS_TOLERANCE["bf16"] * abs(a), (step, a, b)
