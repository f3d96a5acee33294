"""`z3guard doctor` names each hazard kind, reports nothing on clean models, verifies its fix."""
from __future__ import annotations

from pathlib import Path

import pytest

from z3guard import doctor

PROJ = [f"visual.attnpool.{p}_proj.{k}" for p in "ckqv" for k in ("bias", "weight")]


def _kinds(report):
    return {(h.kind, h.module): h for h in report.hazards}


def test_clip_attention_pooling_is_named_with_all_eight_reads_and_the_fix_verified(runs):
    report = doctor.run(doctor.DoctorPlan(scenario="clip", verify=True, out=runs / "doctor-clip"))
    (hazard,) = report.hazards
    assert (hazard.kind, hazard.module) == ("cross-module read", "visual.attnpool")
    assert sorted(hazard.params) == sorted(PROJ)
    assert sorted(hazard.persistent) == [f"visual.attnpool.{p}_proj.bias" for p in "ckqv"]
    path, line = hazard.source.rsplit(":", 1)  # the line of AttentionPool2d.forward that reads them
    assert path.endswith("scenarios/models.py")
    assert "self.c_proj.bias" in Path(path).read_text().splitlines()[int(line) - 1]
    assert hazard.crashes_stock_on == ["resume + skipped step", "resume + GatheredParameters"]
    fix = "deepspeed.zero.register_external_parameter(model.visual.attnpool, model.visual.attnpool.q_proj.bias)"
    assert fix in hazard.fix
    assert report.stock["training from scratch"] == "ok"
    assert report.verified is True and report.z3guard_completed


@pytest.mark.parametrize("scenario,expected", [
    ("side-read", {("cross-module read", "head"), ("read on some steps", "head")}),
    ("skip-block", {("cross-module read", "head"), ("order changes", "blocks.1")}),
    ("twice", {("cross-module read", "head"), ("runs more than once", "blocks.0"),
               ("runs more than once", "blocks.0.fc1"), ("runs more than once", "blocks.0.fc2"),
               ("runs more than once", "blocks.0.norm")}),
])
def test_each_hazard_kind_is_found(runs, scenario, expected):
    report = doctor.run(doctor.DoctorPlan(scenario=scenario, out=runs / f"doctor-{scenario}"))
    assert set(_kinds(report)) == expected
    if scenario == "side-read":
        assert _kinds(report)["read on some steps", "head"].params == ["blocks.0.fc1.weight"]


def test_a_plain_mlp_reports_nothing(runs):
    report = doctor.run(doctor.DoctorPlan(scenario="mlp", out=runs / "doctor-mlp"))
    assert report.hazards == [] and set(report.stock.values()) == {"ok"}


def test_a_tiny_gpt2_from_a_local_config_folder_reports_nothing(runs, tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path)
    report = doctor.run(doctor.DoctorPlan(hf_path=str(tmp_path), out=runs / "doctor-gpt2"))
    assert report.hazards == [] and report.z3guard_completed
