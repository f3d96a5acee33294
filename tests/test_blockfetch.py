"""Each repeated block fetched whole (a ZeRO-3 leaf module) gives the same bytes as stock DeepSpeed."""
from __future__ import annotations

import pytest
from torch import nn

from z3guard.adapter.blockfetch import before_hooks, largest_module, repeated_blocks
from z3guard.scenarios import compare
from z3guard.scenarios.job import Job
from z3guard.scenarios.models import Block, Routed, TinyLM

from .conftest import launch, scripts_on_path

MANY = 10**9
VOCAB = 512  # an embedding (32768) larger than a block (16704), as in a language model of any size


def test_the_repeated_blocks_of_a_module_list_are_chosen():
    model = TinyLM(depth=3, vocab=VOCAB)
    assert repeated_blocks(model, MANY) == list(model.blocks)


def test_a_block_larger_than_the_models_largest_module_stays_per_module():
    """Stock never gathers more than its largest module at once; a block that holds more would raise the
    memory peak (0.8B-parameter blocks beside 0.27B modules: +10% on one H200, docs/benchmarks.md)."""
    model = TinyLM(depth=3)  # embedding 4096, each linear 8320, each block 16704
    assert largest_module(model) == 8320
    assert repeated_blocks(model, MANY) == []


def test_experts_are_chosen_each_not_the_block_that_routes_between_them():
    model = TinyLM(experts=4, depth=2, vocab=VOCAB)  # a routed block would fetch every expert where one runs
    chosen = repeated_blocks(model, MANY)
    assert not any(isinstance(m, Routed) for m in chosen)
    assert chosen == [expert for block in model.blocks for expert in block.experts]


@pytest.mark.parametrize("model, why", [
    (nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "one module each: nothing to fetch together"),
    (nn.Sequential(Block(8), nn.Linear(8, 8)), "a block that does not repeat"),
])
def test_nothing_else_is_chosen(model, why):
    assert repeated_blocks(model, MANY) == [], why


def test_a_block_larger_than_deepspeeds_live_parameter_bound_stays_per_module():
    model = TinyLM(depth=3, width=64, vocab=VOCAB)
    size = sum(p.numel() for p in model.blocks[0].parameters())
    assert repeated_blocks(model, size) == list(model.blocks)
    assert repeated_blocks(model, size - 1) == []


def test_the_users_granularity_is_left_alone():
    from deepspeed.utils import set_z3_leaf_modules

    model = TinyLM(depth=3, vocab=VOCAB)
    set_z3_leaf_modules(model, [nn.LayerNorm])  # any leaf module of the user's
    assert repeated_blocks(model, MANY) == []
    settings = {"max_live_parameters": MANY, "zenflow": False, "zero_module_granularity_threshold": 1000}
    assert before_hooks(TinyLM(depth=3, vocab=VOCAB), settings) == 0


def test_nvme_parameter_offload_keeps_per_module_fetches(caplog):
    """A block would swap in all its partitions at once: more than the NVMe swapper's buffers may hold."""
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig

    settings = {"max_live_parameters": MANY, "zenflow": False, "zero_module_granularity_threshold": 0}
    nvme = DeepSpeedZeroOffloadParamConfig(device="nvme", nvme_path="/tmp")
    cpu = DeepSpeedZeroOffloadParamConfig(device="cpu")
    with caplog.at_level("WARNING", logger="z3guard"):
        assert before_hooks(TinyLM(depth=3, vocab=VOCAB), {**settings, "offload_param_config": nvme}) == 0
    assert "speed path block_fetch off with NVMe parameter offload" in caplog.text
    assert before_hooks(TinyLM(depth=3, vocab=VOCAB), {**settings, "offload_param_config": cpu}) == 3


def test_blocks_fetched_whole_are_bit_identical_over_52_steps_with_skips(runs, monkeypatch):
    """Real ZeRO-3 with both offloads, fp16, the report's tied LM (its head reads the embedding's weight):
    stock against z3guard with its blocks fetched whole (the default) and without."""
    scripts_on_path(monkeypatch)
    skips = [3, 10, 25, 26, 40]
    common = dict(model="checkpointed_lm:plain", batch="checkpointed_lm:batch", hidden=64,
                  config={"fp16": {"initial_scale_power": 8}}, steps=52, skip_at=skips)
    done = launch([Job("stock", **common), Job("blocks", guard=True, **common),
                   Job("modules", guard=True, options={"fast_block_fetch": False}, **common)], runs / "blockfetch")
    blocks, modules = done.result("blocks"), done.result("modules")
    assert "block_fetch=3" in blocks["fast_paths"]
    assert not any(p.startswith("block_fetch") for p in modules["fast_paths"])
    # what ZeRO-3 fetched, as its trace recorded it: a block, or the block's modules one by one
    assert "blocks.0" in blocks["module_counts"] and "blocks.0.fc1" not in blocks["module_counts"]
    assert "blocks.0.fc1" in modules["module_counts"]
    assert done.result("stock")["skipped"] == blocks["skipped"] == modules["skipped"] == skips
    for name in ("blocks", "modules"):  # losses, weights, both ranks' optimizer states
        diff = compare.first_job_difference(done, "stock", name)
        assert diff is None, f"{name}: {diff}"


@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
def test_blocks_fetched_whole_under_activation_checkpointing_are_bit_identical(runs, kind, monkeypatch):
    """Each block recomputed in the backward (Hugging Face's gradient checkpointing does this per layer)."""
    scripts_on_path(monkeypatch)
    common = dict(model=f"checkpointed_lm:{kind}", batch="checkpointed_lm:batch", hidden=64,
                  config={"fp16": {"initial_scale_power": 8}}, steps=14, skip_at=[3, 10],
                  events={"5": ["gathered"], "11": ["eval"]})
    done = launch([Job("stock", **common), Job("blocks", guard=True, **common)], runs / f"blockfetch-{kind}")
    assert "block_fetch=3" in done.result("blocks")["fast_paths"]
    diff = compare.first_job_difference(done, "stock", "blocks")
    assert diff is None, str(diff)


def test_parameters_unused_on_some_steps_keep_stocks_gradients(runs, monkeypatch):
    """Blocks whose extra projection runs on even steps only, and the middle block left out on odd steps.
    DeepSpeed's own leaf module (stock, the blocks marked by hand) reduces a zero gradient for each unused
    parameter, where stock without leaf modules leaves its gradient region as it was: that run leaves
    stock's bits. z3guard fetches the blocks whole and leaves the gradients to stock's per-parameter path."""
    scripts_on_path(monkeypatch)
    common = dict(batch="checkpointed_lm:batch", hidden=64, config={"fp16": {"initial_scale_power": 8}},
                  steps=12, skip_at=[3, 10])
    done = launch([Job("stock", model="checkpointed_lm:gated_skip", **common),
                   Job("leaf-by-hand", model="checkpointed_lm:gated_skip_leaf", **common),
                   Job("blocks", model="checkpointed_lm:gated_skip", guard=True, **common)],
                  runs / "blockfetch-gated")
    assert "block_fetch=3" in done.result("blocks")["fast_paths"]
    assert compare.first_job_difference(done, "stock", "leaf-by-hand") is not None
    diff = compare.first_job_difference(done, "stock", "blocks")
    assert diff is None, str(diff)
