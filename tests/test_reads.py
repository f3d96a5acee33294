"""Every read sees a filled tensor: reads outside engine.forward (real ZeRO-3, 2 gloo ranks).

A module's forward run outside the engine (generate() on the module, as TRL's rollouts do without a full
gather) reads another module's partitioned weight: stock hands out what the partition holds and the
output is silently wrong. Persistent parameters read through `parameters()` between steps: after a
skipped step stock leaves them partitioned (empty). z3guard's reads equal a read after a full gather
(`GatheredParameters`) at every event."""
from __future__ import annotations

import pytest

from z3guard.scenarios import compare
from z3guard.scenarios.job import Job

from .conftest import launch

MODULE_FORWARD = dict(scenario="side-read", steps=6, events={s: ["module-forward"] for s in ("2", "3", "5", "6")})
PARAMS_READ = dict(scenario="tied", steps=6, skip_at=[3], events={str(s): ["params-read"] for s in range(1, 7)})


@pytest.fixture(scope="module")
def reads(runs):
    return launch([Job("forward-guarded", guard=True, **MODULE_FORWARD), Job("forward-stock", **MODULE_FORWARD),
                   Job("params-guarded", guard=True, **PARAMS_READ), Job("params-stock", **PARAMS_READ)],
                  runs / "reads")


def _events(done, job, rank, key):
    return {step: seen[key] for step, seen in done.result(job, rank)["event_results"].items()}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_module_forward_outside_the_engine_reads_the_whole_weight(reads, rank):
    """At steps 3 and 6 the head reads blocks.0.fc1.weight, which stock hands out not gathered: in flight
    (whether its buffer is already filled is a race, which gloo's small gathers often win) or partitioned."""
    stock = _events(reads, "forward-stock", rank, "module_forward_read_states")
    assert stock["2"] == stock["5"] == [] and stock["3"] in (["INFLIGHT"], ["NOT_AVAILABLE"]), stock
    guarded = _events(reads, "forward-guarded", rank, "module_forward_read_states")
    assert guarded["3"] == guarded["6"] == ["AVAILABLE"], guarded
    assert set(_events(reads, "forward-guarded", rank, "module_forward_equal").values()) == {True}
    assert reads.result("forward-guarded", rank)["crash"] is None


@pytest.mark.parametrize("rank", [0, 1])
def test_persistent_parameters_read_between_steps_are_whole_after_a_skipped_step(reads, rank):
    stock = _events(reads, "params-stock", rank, "params_read_equal")
    assert stock == {str(s): s != 3 for s in range(1, 7)}  # step 3 is skipped: stock leaves them empty
    assert set(_events(reads, "params-guarded", rank, "params_read_equal").values()) == {True}


def test_gathering_them_again_changes_no_result(reads):
    assert reads.result("params-guarded")["skipped"] == [3]
    assert compare.first_job_difference(reads, "params-stock", "params-guarded") is None
