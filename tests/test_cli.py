"""The command line refuses bad input by its flag before any rank starts (in-process, no group), and
resolves a user's DeepSpeed config as Trainer does."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from z3guard.cli import app


def USER(model: str, batch: str) -> list[str]:  # noqa: N802 (reads as the flags it makes)
    return ["--model", f"tests.scripts.user_models:{model}", "--batch", f"tests.scripts.user_models:{batch}"]


@pytest.mark.parametrize("config,expected", [
    ("{not json", "not JSON"),
    ('{"zero_optimization": {"stage": 2}}', "zero_optimization.stage: expected 3"),
    ('{"zero_optimization": {"stage": 3, "offload_param": {"device": "auto"}}}',
     'zero_optimization.offload_param.device: "auto" that Trainer would not resolve'),
    ('{"zero_optimization": {"stage": 3}, "train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}',
     "train_batch_size 6 != train_micro_batch_size_per_gpu 4"),
])
def test_a_bad_deepspeed_config_is_refused_naming_the_key(tmp_path, config, expected):
    path = tmp_path / "ds_config.json"
    path.write_text(config)
    test_bad_input_is_refused_before_any_rank_starts(tmp_path, ["doctor", "--config", str(path)], expected)


def test_auto_values_resolve_as_trainer_resolves_them(tmp_path):
    """Hugging Face's ZeRO-3 example config (optimizer and scheduler blocks "auto" too), filled by
    transformers' own HfTrainerDeepSpeedConfig for a Trainer with the jobs' arguments and by z3guard."""
    from types import SimpleNamespace

    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from z3guard.scenarios import config

    user = config.merge(config.HF_ZERO3_EXAMPLE, {
        "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
        "scheduler": {"type": "WarmupDecayLR", "params": {k: "auto" for k in (
            "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}}})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=config.LEARNING_RATE, weight_decay=config.WEIGHT_DECAY, max_grad_norm=1.0,
                             bf16=True, warmup_steps=5, use_cpu=True, report_to=[])
    hf = HfTrainerDeepSpeedConfig(config.merge(user, {}))
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 10)
    ours = config.resolve_auto(64, "bf16", 4, 1, grad_accum=2, base=user, total_steps=10)
    assert ours.pop("zero_force_ds_cpu_optimizer") is False  # z3guard's, with an optimizer block or without
    assert ours == hf.config
    assert config.config_dtype(user) is None and config.config_dtype(ours) == "bf16"


@pytest.mark.parametrize("args,expected", [
    (["verify-resume", "--save-after", "8", "--steps", "8"], "need 0 < --save-after < --steps"),
    (["verify-resume", "--model", "no_such_module:f", "--batch", "x:y"],
     "--model 'no_such_module:f': cannot import it"),
    (["verify-resume", "--model", "z3guard.scenarios.models:PlainMLP"], "needs both --model"),
    (["doctor", "--scenario", "no-such-scenario"], "unknown scenario 'no-such-scenario'"),
    (["doctor", "--hf", "/no/such/folder"], "--hf /no/such/folder: not a folder"),
    (["doctor", *USER("resnet_pool", "images_without_micro")], "--batch tests.scripts.user_models:images_without_"
     "micro: expected a function (step, micro, rank, dtype) -> (args, kwargs, target), its signature is (step"),
    (["verify-resume", *USER("resnet_pool", "not_a_batch")], "expected (args: tuple, kwargs: dict, target: Tensor), "
     "it returned a tuple of 1: (Tensor)"),
    (["doctor", *USER("images", "images")], "--model tests.scripts.user_models:images: expected a function () -> "
     "torch.nn.Module"),
    (["doctor", *USER("resnet_pool", "images"), "--loss", "tests.scripts.user_models:resnet_pool"],
     "--loss tests.scripts.user_models:resnet_pool: expected a function (output, target) -> loss"),
    (["doctor", *USER("unbuildable", "images")], "--model tests.scripts.user_models:unbuildable raised "
     "RuntimeError: Trying to create tensor with negative dimension -1"),
    (["doctor", "--layers", "2"], "--layers applies to --hf"),
    (["doctor", "--nproc", "0"], "--nproc"),
    (["doctor", "--config", "/no/such/ds_config.json"], "--config: cannot read it"),
])
def test_bad_input_is_refused_before_any_rank_starts(tmp_path, args, expected):
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.replace("│", " ").split())
    assert not (tmp_path / "out").exists()  # nothing launched
