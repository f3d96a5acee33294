"""The speed paths at 3 and 4 ranks: partitions that do not divide evenly (3) and the next even count (4),
on a model whose order changes and whose parameters go unused on odd steps (the middle block is left out,
and each block's extra projection does not run). The rest of the suite runs 2 ranks."""
from __future__ import annotations

import os

import pytest

from z3guard.scenarios import compare
from z3guard.scenarios.catalog import LM_SCALE
from z3guard.scenarios.job import Job
from z3guard.scenarios.launch import run_jobs

from .conftest import LAUNCH_TIMEOUT, scripts_on_path

DS_ADAM = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "zero_optimization": {"sub_group_size": 5000}}
# 30 steps in the main suite; Z3GUARD_MATRIX=full runs 56, with two more skipped steps past 30
STEPS = 56 if os.environ.get("Z3GUARD_MATRIX") == "full" else 30
SKIPS = [s for s in (3, 10, 25, 26, 41, 53) if s <= STEPS]  # one right after another too
SPEED_PATHS = {"block_fetch=3", "writeback", "fused_step", "grad_offload", "grads_cast_on_host", "overflow_check",
               "persistent_gather", "host_threads=2", "lean_hooks", "grad_bucket"}


@pytest.fixture(scope="module", params=[3, 4])
def ranks(request, runs):
    """Stock, z3guard with its defaults, and stock with the blocks made leaf modules by hand (DeepSpeed's
    own whole-block path), in one group of 3 or 4 ranks."""
    common = dict(batch="checkpointed_lm:batch", hidden=64, config={**DS_ADAM, **LM_SCALE}, steps=STEPS,
                  skip_at=SKIPS)
    jobs = [Job("stock", model="checkpointed_lm:gated_skip", **common),
            Job("fast", model="checkpointed_lm:gated_skip", guard=True, options={"host_threads": 2}, **common),
            Job("leaf-by-hand", model="checkpointed_lm:gated_skip_leaf", **{**common, "steps": 12})]
    with pytest.MonkeyPatch.context() as monkeypatch:
        scripts_on_path(monkeypatch)
        done = run_jobs(jobs, runs / f"world-{request.param}", nproc=request.param, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.log[-6000:]
    return request.param, done


def test_every_speed_path_is_bit_identical_to_stock(ranks):
    """DeepSpeedCPUAdam on both offloads, fp16, several optimizer sub-groups, skipped steps, parameters
    unused on odd steps: stock against z3guard with every speed path on (blocks fetched whole included)."""
    nproc, done = ranks
    stock, fast = done.result("stock"), done.result("fast")
    assert set(fast["fast_paths"]) == SPEED_PATHS and fast["trace"]["switches"] > 0  # and multi_trace
    assert stock["skipped"] == fast["skipped"] and set(SKIPS) <= set(stock["skipped"])  # fp16 overflows too
    diff = compare.first_job_difference(done, "stock", "fast", nproc=nproc)  # losses, weights, every optimizer
    assert diff is None, str(diff)


def test_deepspeeds_own_leaf_modules_leave_stocks_bits(ranks):
    """What the whole-block fetch avoids: DeepSpeed's leaf modules reduce a block's gradients together
    after its backward (at other bucket offsets, so at 3+ ranks other summation orders) and a zero one for
    each unused parameter. Stock with the blocks marked by hand ends on other bits."""
    nproc, done = ranks
    by_hand, stock = done.result("leaf-by-hand")["losses"], done.result("stock")["losses"]
    assert by_hand != {step: loss for step, loss in stock.items() if int(step) <= 12}
    assert compare.first_job_difference(done, "stock", "leaf-by-hand", nproc=nproc) is not None
