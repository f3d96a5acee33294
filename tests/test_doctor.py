"""`z3guard doctor` names each hazard kind, reports nothing on clean models, verifies its fix, and never
gives an all-clear from a run that failed for another reason."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from z3guard import doctor
from z3guard.cli import app


def _kinds(report):
    return {(h.kind, h.module): h for h in report.hazards}


def _cli(args: list[str], out: Path) -> tuple[int, str, dict]:
    """The command as a user runs it; its exit status, its output on one line, its --json verdict."""
    result = CliRunner().invoke(app, [*args, "--out", str(out), "--json", str(out) + ".json"])
    text = " ".join(result.output.replace("│", " ").split())
    verdict = json.loads(Path(str(out) + ".json").read_text()) if Path(str(out) + ".json").exists() else {}
    return result.exit_code, text, verdict


USER = ["--model", "tests.scripts.user_models:resnet_pool", "--batch", "tests.scripts.user_models:images",
        "--hidden", "64"]


def test_a_resnet_with_batchnorm_and_attention_pooling_is_diagnosed_and_resumes_bit_identically(runs):
    """A user's model (CLIP's ResNet tower in small) through the command line, built as Hugging Face builds
    ZeRO-3 models: its BatchNorm buffers train in fp16, its eight hazardous reads are named with the stock
    crashes they cause and the fix, and the fix is verified."""
    code, text, report = _cli(["doctor", *USER, "--verify"], runs / "doctor-resnet")
    assert code == 1, text  # hazards found
    (hazard,) = report["hazards"]
    assert (hazard["kind"], hazard["module"]) == ("cross-module read", "attnpool")
    assert sorted(hazard["params"]) == sorted(f"attnpool.{p}_proj.{k}" for p in "ckqv" for k in ("bias", "weight"))
    assert sorted(hazard["persistent"]) == [f"attnpool.{p}_proj.bias" for p in "ckqv"]
    path, line = hazard["source"].rsplit(":", 1)  # the line of AttentionPool2d.forward that reads them
    assert path.endswith("scenarios/models.py")
    assert "self.c_proj.bias" in Path(path).read_text().splitlines()[int(line) - 1]
    assert hazard["crashes_stock_on"] == ["resume + skipped step", "resume + GatheredParameters"]
    assert "deepspeed.zero.register_external_parameter(model.attnpool, model.attnpool.q_proj.bias)" in hazard["fix"]
    assert report["stock"]["training from scratch"] == "ok"
    assert report["verified"] is True and report["z3guard_completed"] and report["status"] == 1
    assert "no ZeRO-3 trace hazards found" not in text

    code, text, verdict = _cli(["verify-resume", *USER], runs / "verify-resnet")
    assert code == 0 and verdict["identical"], text
    assert "bit-identical" in text


def test_a_run_that_fails_for_another_reason_is_named_with_its_traceback_and_exit_3(runs):
    """No all-clear from a run that did not run: the user's own bug, and BatchNorm's fp32 buffers in a
    model built plainly and handed to DeepSpeed (the failure that building under zero.Init avoids)."""
    broken = ["--model", "tests.scripts.user_models:broken", "--batch", "tests.scripts.user_models:images"]
    for command, run in (("doctor", "observe"), ("verify-resume", "straight")):
        code, text, verdict = _cli([command, *broken], runs / f"broken-{command}")
        assert code == 3, text
        assert f"run '{run}' failed at step 1" in text
        assert "ValueError: the user's model fails here on purpose" in text
        assert "in your code" in text and "user_models.py" in text and "flatten_wrongly" in text
        assert "Traceback (most recent call last)" in text and "no conclusion is drawn" in text
        assert "no ZeRO-3 trace hazards found" not in text and "bit-identical" not in text
        assert verdict["status"] == 3 and verdict["failure"]["step"] == 1

    code, text, verdict = _cli(["verify-resume", *USER, "--init", "plain", "--steps", "3", "--save-after", "2"],
                               runs / "plain-resnet")
    assert code == 3, text
    failure = verdict["failure"]
    assert failure["step"] == 1 and "batch_norm" in failure["traceback"], failure
    assert any("user_models.py" in f and "bn1" in f for f in failure["user_frames"]), failure


@pytest.mark.parametrize("scenario,expected", [
    ("side-read", {("cross-module read", "head"), ("read on some steps", "head")}),
    ("skip-block", {("cross-module read", "head"), ("order changes", "blocks.1")}),
    ("rank-branch", {("ranks run different modules", "extra")}),
    ("twice", {("cross-module read", "head"), ("runs more than once", "blocks.0"),
               ("runs more than once", "blocks.0.fc1"), ("runs more than once", "blocks.0.fc2"),
               ("runs more than once", "blocks.0.norm")}),
])
def test_each_hazard_kind_is_found(runs, scenario, expected):
    report = doctor.run(doctor.DoctorPlan(scenario=scenario, out=runs / f"doctor-{scenario}"))
    assert set(_kinds(report)) == expected
    if scenario == "side-read":
        assert _kinds(report)["read on some steps", "head"].params == ["blocks.0.fc1.weight"]


def test_a_32_layer_llama_config_is_examined_with_2_layers_and_its_layers_agree(runs, tmp_path):
    """`--hf FOLDER --layers N`: the hazards of a decoder repeat per layer, so N of them tell as much."""
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=32, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=64).save_pretrained(tmp_path)
    code, text, report = _cli(["doctor", "--hf", str(tmp_path), "--layers", "2"], runs / "doctor-llama")
    assert code == 0 and report["status"] == 0, text
    assert report["hazards"] == [] and "no ZeRO-3 trace hazards found" in text
    counts = report["module_counts"]
    layers = {m.split(".")[2] for m in counts if m.startswith("model.layers.")}
    assert layers == {"0", "1"}
    per_layer = [{m.replace(f"layers.{i}.", "layers.N."): n for m, n in counts.items() if f"layers.{i}." in m}
                 for i in (0, 1)]
    assert per_layer[0] == per_layer[1] and per_layer[0]


def test_the_users_deepspeed_config_and_the_models_own_loss(runs, tmp_path):
    """`--config`: Hugging Face's example with its optimizer and scheduler left "auto", resolved as Trainer
    does (DeepSpeed then builds its own CPU Adam); the model returns its loss, a scalar, which is used as is."""
    from z3guard.scenarios import config

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config.merge(config.HF_ZERO3_EXAMPLE, {
        "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
        "scheduler": {"type": "WarmupDecayLR", "params": {k: "auto" for k in (
            "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}}})))
    user = ["--model", "tests.scripts.user_models:own_loss", "--batch", "tests.scripts.user_models:images_and_labels",
            "--hidden", "64", "--config", str(path), "--dtype", "bf16"]
    code, text, verdict = _cli(["verify-resume", *user], runs / "verify-own-loss")
    assert code == 0 and verdict["identical"], text
    spec = json.loads((runs / "verify-own-loss" / "second" / "spec.json").read_text())
    assert spec["jobs"][0]["ds_config"]["scheduler"]["type"] == "WarmupDecayLR"
    assert spec["jobs"][0]["dtype"] == "bf16"
