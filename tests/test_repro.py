"""The report's crash, reproduced on stock DeepSpeed, and the guarded resume."""
from __future__ import annotations

import pytest

from z3guard.scenarios import compare, repro
from z3guard.scenarios.job import Job
from z3guard.scenarios.launch import launch_command

from .conftest import launch

BIASES = [f"visual.attnpool.{p}_proj.bias" for p in ("c", "k", "q", "v")]


@pytest.fixture(scope="module")
def verdict(runs):
    return repro.run(repro.ReproPlan(out=runs / "repro"))


def test_stock_crashes_with_the_reports_signature(verdict):
    stock = next(r for r in verdict.rows if r.run.startswith("stock"))
    assert stock.outcome == "crashed"
    crash = stock.crash
    assert crash["step"] == 7  # the step after the forced skip at 6
    assert crash["message"].startswith("tracing error at step")
    assert "expected the next 4 parameters in the parameter fetch queue" in crash["message"]
    assert crash["message"].rstrip().endswith("but got \n ().")
    assert crash["module"] == "visual.attnpool"
    assert crash["params"] == BIASES


def test_guarded_resume_is_bit_identical_to_the_uninterrupted_run(verdict):
    guarded = next(r for r in verdict.rows if r.run.startswith("z3guard"))
    assert guarded.outcome == "completed"
    assert guarded.matches_reference is True
    assert verdict.as_expected


def test_the_report_under_deepspeeds_own_launcher(runs):
    """`deepspeed --num_gpus 2` starts the ranks instead of torchrun: the same crash, the same resume."""
    verdict = repro.run(repro.ReproPlan(out=runs / "repro-deepspeed-launcher", launcher="deepspeed"))
    stock = next(r for r in verdict.rows if r.run.startswith("stock"))
    assert stock.crash["params"] == BIASES and verdict.as_expected
    assert "deepspeed.launcher.launch" in (runs / "repro-deepspeed-launcher" / "phase2" / "launch.log").read_text()


@pytest.mark.parametrize("device,visible,expected", [
    ("cuda", "2,3", ["--include=localhost:2,3"]),  # DeepSpeed's runner would drop the variable for GPUs 0, 1
    ("cuda", "1,2,3", ["--include=localhost:1,2"]),
    ("cuda", "", ["--num_gpus=2"]),
    ("cpu", "2,3", ["--num_gpus=2"]),
])
def test_deepspeeds_launcher_keeps_to_the_visible_gpus(device, visible, expected):
    cmd = launch_command("deepspeed", 2, ["-m", "pkg.mod", "x"], device, {"CUDA_VISIBLE_DEVICES": visible})
    assert [a for a in cmd if a.startswith(("--include", "--num_gpus"))] == expected
    assert cmd[-3:] == ["--module", "pkg.mod", "x"] and "--no_local_rank" in cmd


def test_deepspeeds_launcher_refuses_too_few_visible_gpus():
    with pytest.raises(ValueError, match="2 ranks, but CUDA_VISIBLE_DEVICES=5 names 1 GPU"):
        launch_command("deepspeed", 2, ["script.py"], "cuda", {"CUDA_VISIBLE_DEVICES": "5"})


def test_plain_resume_without_skipped_steps_matches_the_reference(runs):
    ckpt = str(runs / "plain" / "ckpt")
    first = launch([Job("phase1", steps=3, save_at=[3], save_dir=ckpt),
                    Job("reference", steps=6)], runs / "plain" / "a")
    second = launch([Job("resumed", steps=6, load_dir=ckpt)], runs / "plain" / "b")
    ref, res = first.result("reference"), second.result("resumed")
    assert res["crash"] is None and res["start"] == 3 and res["skipped"] == []
    assert compare.first_loss_difference(ref["losses"], res["losses"]) is None
    assert compare.first_tensor_difference(first.state("reference"), second.state("resumed")) is None
