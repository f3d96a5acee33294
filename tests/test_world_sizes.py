"""The speed paths at 3 and 4 ranks: partitions that do not divide evenly (3) and the next even count (4),
on a model whose order changes and whose skipped block leaves parameters unused on odd steps. The rest of
the suite runs 2 ranks."""
from __future__ import annotations

import os

import pytest

from z3guard.scenarios import compare
from z3guard.scenarios.job import Job
from z3guard.scenarios.launch import run_jobs

from z3guard.adapter import blockfetch
from z3guard.scenarios.catalog import LM_SCALE

from .conftest import LAUNCH_TIMEOUT

DS_ADAM = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "zero_optimization": {"sub_group_size": 5000}}
# 30 steps in the main suite; Z3GUARD_MATRIX=full runs 56, with two more skipped steps past 30
STEPS = 56 if os.environ.get("Z3GUARD_MATRIX") == "full" else 30
SKIPS = [s for s in (3, 10, 25, 26, 41, 53) if s <= STEPS]  # one right after another too
OTHER_PATHS = {"writeback", "fused_step", "grad_offload", "grads_cast_on_host", "overflow_check",
               "persistent_gather", "host_threads=2", "lean_hooks", "quiet_modules=3"}


def skip_block(leaf_blocks: bool = False):
    """The skip-block scenario's model for a stock run (a rank imports it by name)."""
    from z3guard.scenarios.models import TinyLM

    model = TinyLM(skip_odd=True)
    if leaf_blocks:  # what block_fetch does: each block a ZeRO-3 leaf module, fetched and reduced whole
        from deepspeed.utils import set_z3_leaf_module

        for block in model.blocks:
            set_z3_leaf_module(block, True)
    return model


def skip_block_with_leaf_blocks():
    return skip_block(leaf_blocks=True)


@pytest.fixture(scope="module", params=[3, 4])
def ranks(request, runs):
    """Stock, z3guard with its defaults, and stock with the blocks made leaf modules by hand (what
    block_fetch does), in one group of 3 or 4 ranks."""
    common = dict(steps=STEPS, skip_at=SKIPS)
    by_hand = dict(batch="z3guard.scenarios.catalog:_token_batch", hidden=64, config={**DS_ADAM, **LM_SCALE},
                   steps=16, skip_at=[s for s in SKIPS if s <= 16])
    jobs = [Job("stock", scenario="skip-block", config=DS_ADAM, **common),
            Job("fast", scenario="skip-block", guard=True, options={"host_threads": 2, "fast_block_fetch": True},
                config=DS_ADAM, **common),
            Job("stock-modules", model=f"{__name__}:skip_block", **by_hand),
            Job("stock-blocks", model=f"{__name__}:skip_block_with_leaf_blocks", **by_hand)]
    done = run_jobs(jobs, runs / f"world-{request.param}", nproc=request.param, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.log[-6000:]
    return request.param, done


def test_every_other_speed_path_is_bit_identical_to_stock(ranks):
    """DeepSpeedCPUAdam on both offloads, fp16, several optimizer sub-groups, skipped steps, a block skipped
    on odd steps: stock against z3guard with every speed path on that is on at this many ranks."""
    nproc, done = ranks
    stock, fast = done.result("stock"), done.result("fast")
    assert set(fast["fast_paths"]) == OTHER_PATHS and fast["trace"]["switches"] > 0  # and multi_trace
    assert stock["skipped"] == fast["skipped"] and set(SKIPS) <= set(stock["skipped"])  # fp16 overflows too
    diff = compare.first_job_difference(done, "stock", "fast", nproc=nproc)  # losses, weights, every optimizer
    assert diff is None, str(diff)
    assert "speed path block_fetch off at " + str(nproc) + " ranks" in done.log


def test_blocks_fetched_whole_are_left_to_1_or_2_ranks(ranks):
    """Stock itself, with the blocks as leaf modules, reduces their gradients in another order at 3 ranks
    and ends on other bits: z3guard does not fetch blocks whole past 2 ranks, and says so once."""
    nproc, done = ranks
    assert blockfetch.PROVEN_RANKS == 2
    by_hand, stock = done.result("stock-modules")["losses"], done.result("stock")["losses"]
    assert by_hand == {step: loss for step, loss in stock.items() if int(step) <= 16}  # the same run, by hand
    if nproc == 3:
        assert compare.first_job_difference(done, "stock-modules", "stock-blocks", nproc=nproc) is not None
    assert done.log.count(f"speed path block_fetch off at {nproc} ranks") == 1  # rank 0, once
