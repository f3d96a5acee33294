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


def resolve_auto(hidden_size: int, dtype: str, micro_batch: int, world_size: int, grad_accum: int = 1,
                 max_grad_norm: float = 1.0) -> dict[str, Any]:
    """Fill "auto" the way `transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig` does.

    Trainer derives the ZeRO-3 sizes from the model's hidden size: reduce bucket h*h, prefetch
    bucket 0.9*h*h, persistence threshold 10*h. With h=512 that makes 512-element biases persistent
    and 512x512 weights not, which is exactly the split the report's traceback shows.
    """
    cfg = copy.deepcopy(HF_ZERO3_EXAMPLE)
    z = cfg["zero_optimization"]
    z["reduce_bucket_size"] = hidden_size * hidden_size
    z["stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
    z["stage3_param_persistence_threshold"] = 10 * hidden_size
    cfg["fp16"]["enabled"] = dtype == "fp16"
    cfg["bf16"]["enabled"] = dtype == "bf16"
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg["gradient_clipping"] = max_grad_norm
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["train_batch_size"] = micro_batch * grad_accum * world_size
    # Trainer passes its own torch AdamW when the config has no "optimizer" block; DeepSpeed then
    # insists on its CPU Adam for offload unless told otherwise (its JIT build takes minutes here).
    cfg["zero_force_ds_cpu_optimizer"] = False
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
