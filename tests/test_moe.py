"""Mixture-of-experts models built from their transformers configs, each rank routing its own tokens
(real ZeRO-3, 2 gloo ranks, no `set_z3_leaf_modules`).

With transformers 4, each expert was a module of its own: a rank whose tokens skipped an expert skipped its
module, and ranks routing differently ran different modules (stock hung or raised before DeepSpeed 0.18
made these blocks leaf modules by default). transformers 5 keeps all experts in one module of stacked
weights, so every rank runs the same modules whatever its routing. Either way z3guard must complete as
stock does, bit for bit, with a skipped step in the run."""
from __future__ import annotations

import pytest

from z3guard.scenarios import compare
from z3guard.scenarios.job import Job

from .conftest import launch


def _configs(root):
    from transformers import MixtralConfig, Qwen2MoeConfig

    small = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64)
    MixtralConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=1, **small).save_pretrained(
        root / "mixtral")
    Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
                   num_experts_per_tok=1, **small).save_pretrained(root / "qwen2-moe")
    return {name: str(root / name) for name in ("mixtral", "qwen2-moe")}


@pytest.fixture(scope="module")
def moe(runs):
    paths = _configs(runs)
    jobs = []
    for name, path in paths.items():
        common = dict(hf_path=path, steps=6, skip_at=[3], construct="zero-init")
        jobs += [Job(f"{name}-stock", **common), Job(f"{name}-guarded", guard=True, **common)]
    return launch(jobs, runs / "moe")


@pytest.mark.parametrize("model", ["mixtral", "qwen2-moe"])
def test_each_rank_routing_its_own_tokens_completes_as_stock(moe, model):
    for rank in (0, 1):
        assert moe.result(f"{model}-guarded", rank)["crash"] is None
        assert moe.result(f"{model}-stock", rank)["crash"] is None
    assert moe.result(f"{model}-guarded")["skipped"] == [3]
    assert moe.result(f"{model}-guarded", 0)["losses"] != moe.result(f"{model}-guarded", 1)["losses"]  # own data
    assert compare.first_job_difference(moe, f"{model}-stock", f"{model}-guarded") is None
