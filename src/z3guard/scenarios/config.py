"""The DeepSpeed configuration the report most likely ran, with Trainer's "auto" values resolved."""
from __future__ import annotations

import copy
from typing import Any

# Hugging Face's documented ZeRO-3 example (docs "DeepSpeed" page, ZeRO-3 with CPU offload).
HF_ZERO3_EXAMPLE: dict[str, Any] = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


class ConfigError(ValueError):
    """A DeepSpeed config that cannot run the job; the message names the key."""


LEARNING_RATE = 1e-3  # the jobs' own (torch AdamW, warm-up to it)
WEIGHT_DECAY = 0.01


def resolve_auto(hidden_size: int, dtype: str, micro_batch: int, world_size: int, grad_accum: int = 1,
                 max_grad_norm: float = 1.0, base: dict[str, Any] | None = None,
                 total_steps: int = 10) -> dict[str, Any]:
    """Fill "auto" the way `transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig` does, for a
    Trainer whose arguments are the job's (batch, precision, learning rate, clipping, warm-up).

    Trainer derives the ZeRO-3 sizes from the model's hidden size: reduce bucket h*h, prefetch
    bucket 0.9*h*h, persistence threshold 10*h. With h=512 that makes 512-element biases persistent
    and 512x512 weights not, which is exactly the split the report's traceback shows.

    `base` is the user's config (default: Hugging Face's ZeRO-3 example, every size "auto"): its explicit
    values stay as they are. The batch sizes left must agree with the world size, as DeepSpeed requires.
    """
    cfg = copy.deepcopy(HF_ZERO3_EXAMPLE if base is None else base)
    z = cfg.get("zero_optimization", {})
    if z.get("stage") != 3:
        raise ConfigError(f"zero_optimization.stage: expected 3 (z3guard examines ZeRO stage 3), got {z.get('stage')!r}")
    fill = {
        ("fp16", "enabled"): dtype == "fp16",
        ("bf16", "enabled"): dtype == "bf16",
        ("zero_optimization", "reduce_bucket_size"): hidden_size * hidden_size,
        ("zero_optimization", "stage3_prefetch_bucket_size"): int(0.9 * hidden_size * hidden_size),
        ("zero_optimization", "stage3_param_persistence_threshold"): 10 * hidden_size,
        ("gradient_clipping",): max_grad_norm,
        ("optimizer", "params", "lr"): LEARNING_RATE,
        ("optimizer", "params", "betas"): [0.9, 0.999],
        ("optimizer", "params", "eps"): 1e-8,
        ("optimizer", "params", "weight_decay"): WEIGHT_DECAY,
        ("scheduler", "params", "warmup_min_lr"): 0.0,
        ("scheduler", "params", "warmup_max_lr"): LEARNING_RATE,
        ("scheduler", "params", "warmup_num_steps"): 5,
        ("scheduler", "params", "total_num_steps"): total_steps,
    }
    for path, value in fill.items():
        *parents, key = path
        node = cfg
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(key) == "auto":
            node[key] = value
    _resolve_batch(cfg, micro_batch, grad_accum, world_size)
    if left := _autos(cfg):
        raise ConfigError(f"{', '.join(left)}: \"auto\" that Trainer would not resolve either; give a value")
    # Trainer passes its own torch AdamW when the config has no "optimizer" block; DeepSpeed then
    # insists on its CPU Adam for offload unless told otherwise (its JIT build takes minutes here).
    cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    return cfg


def _resolve_batch(cfg: dict[str, Any], micro: int, accum: int, world: int) -> None:
    """train_batch_size = micro batch x accumulation x world size, each "auto" or missing one filled."""
    def given(key: str) -> int | None:
        value = cfg.get(key, "auto")
        return None if value == "auto" else value

    mb, ga, tb = given("train_micro_batch_size_per_gpu"), given("gradient_accumulation_steps"), given("train_batch_size")
    mb = mb or (tb // ((ga or accum) * world) if tb and tb % ((ga or accum) * world) == 0 else micro)
    ga = ga or (tb // (mb * world) if tb and tb % (mb * world) == 0 else accum)
    tb = tb or mb * ga * world
    if tb != mb * ga * world:
        raise ConfigError(f"train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} x "
                          f"gradient_accumulation_steps {ga} x {world} ranks")
    cfg.update(train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga, train_batch_size=tb)


def _autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [a for k, v in node.items() for a in _autos(v, f"{prefix}.{k}" if prefix else str(k))]
    return [prefix] if node == "auto" else []


def config_dtype(cfg: dict[str, Any]) -> str | None:
    """The precision a config fixes ("fp16", "bf16", "fp32"), or None where it leaves it "auto"."""
    fp16, bf16 = (cfg.get(k, {}).get("enabled", False) for k in ("fp16", "bf16"))
    if fp16 == "auto" or bf16 == "auto":
        return None if not (fp16 is True or bf16 is True) else ("fp16" if fp16 is True else "bf16")
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def load(path: str) -> dict[str, Any]:
    """A DeepSpeed JSON config file; errors name the file and what is wrong."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config {path}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"--config {path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `base` (dicts merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
