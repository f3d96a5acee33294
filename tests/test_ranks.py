"""Ranks decide together: a cross-module read that happens on one rank only must not change that rank's
gathers alone (real ZeRO-3, 2 gloo ranks, each rank its own batches)."""
from __future__ import annotations

import pytest

from z3guard.scenarios import compare
from z3guard.scenarios.job import Job
from z3guard.scenarios.launch import LaunchError, run_jobs

from .conftest import launch

STEPS = 12
COMMON = dict(scenario="rank-read", steps=STEPS, skip_at=[3, 8], events={"6": ["gathered"]})


@pytest.fixture(scope="module")
def runs_of_rank_reads(runs):
    done = launch([Job("registered", preregister=True, **COMMON), Job("guarded", guard=True, **COMMON)],
                  runs / "rank-reads")
    try:  # stock may hang (a gather on the reading rank alone): recorded under a timeout, never waited on
        stock = run_jobs([Job("stock", **COMMON)], runs / "rank-reads-stock", timeout=150)
        stock_outcome = "completed" if stock.returncode == 0 and stock.result("stock")["crash"] is None else "crashed"
    except LaunchError:
        stock_outcome = "hung"
    return done, stock_outcome


def test_the_read_happens_on_one_rank_only_on_some_steps(runs_of_rank_reads):
    done, _ = runs_of_rank_reads
    rank0, rank1 = (set(done.result("guarded", r)["data_read_steps"]) for r in (0, 1))
    assert rank0 - rank1 and rank1 - rank0, (rank0, rank1)  # each rank reads on steps the other does not


def test_z3guard_completes_as_with_register_external_parameter_and_the_ranks_agree(runs_of_rank_reads):
    """Bit for bit: losses, gathered weights and both ranks' optimizer partitions, against stock with the
    documented workaround. Before the ranks agreed, the reading rank alone re-recorded its trace and both
    ranks hung in mismatched collectives."""
    done, stock_outcome = runs_of_rank_reads
    # stock: the reading rank gathers the parameter alone at step 1 (gloo aborts on the size mismatch;
    # NCCL would hang)
    assert stock_outcome in ("crashed", "hung")
    guarded = done.result("guarded")
    assert guarded["crash"] is None and guarded["skipped"] == [3, 8]
    assert done.result("guarded", 1)["crash"] is None
    diff = compare.first_job_difference(done, "registered", "guarded")
    assert diff is None, f"{diff} (stock without the workaround: {stock_outcome})"
    # the read, registered on both ranks at the step boundary after rank 0 first made it
    assert [d for d in guarded["divergences"] if d["kind"] == "tracing-error"] == []
    assert any(r["param"] == "blocks.0.norm.bias" for r in guarded["reads"])


BRANCH = dict(scenario="rank-branch", steps=6, options={"lockstep_timeout": 30})


@pytest.fixture(scope="module")
def runs_of_a_rank_branch(runs):
    """Rank 0's batch at step 4 brings an image (its branch module runs), rank 1's does not. Stock: the
    ranks' gathers no longer pair; gloo's collective timeout, set to 20 s here (30 minutes by default), ends
    the hang."""
    guarded = run_jobs([Job("guarded", guard=True, **BRANCH)], runs / "rank-branch", timeout=120)
    stock = run_jobs([Job("stock", **BRANCH)], runs / "rank-branch-stock", timeout=120,
                     env={"Z3GUARD_COLLECTIVE_TIMEOUT": "20"})
    return guarded, stock


def test_ranks_running_different_modules_all_stop_with_an_error_naming_the_module(runs_of_a_rank_branch):
    """Rank 0 raises the error; rank 1, blocked in a gather that rank 0 will never join (a gloo wait cannot
    be freed; NCCL's abort frees it and the rank raises too), prints it and is ended within seconds."""
    guarded, stock = runs_of_a_rank_branch
    # the first rank whose collective times out ends; the other then sees its peer's connection close
    hung = [stock.result("stock", rank)["crash"] for rank in (0, 1)]
    assert all(h["step"] == 4 for h in hung), hung
    assert any("Timed out waiting" in h["message"] for h in hung), hung
    assert all("Timed out waiting" in h["message"] or "Connection closed by peer" in h["message"] for h in hung), hung
    assert guarded.seconds < 60, "the ranks must stop well within the launch's timeout"
    crash = guarded.result("guarded", 0)["crash"]
    assert crash is not None and crash["step"] == 4 and crash["exception"] == "RankDivergenceError", crash
    message = crash["message"]
    assert "rank 0 ran `extra` outside the recorded order where rank 1 ran `blocks.0`'s forward" in message
    assert "register_external_parameter" in message and "dummy input" in message
    if (guarded.out / "guarded.rank1.json").exists():
        assert guarded.result("guarded", 1)["crash"]["message"] == message
    else:
        assert f"[rank 1] {message}" in guarded.log
