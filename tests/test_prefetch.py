"""Prefetch survives a module order that changes every step (a block skipped on odd steps;
routing that picks one of four experts per layer)."""
from __future__ import annotations

from z3guard.diagnose import Diagnostics, Divergence
from z3guard.scenarios import compare
from z3guard.scenarios.job import Job

from .conftest import launch


def test_alternating_order_switches_traces_instead_of_rerecording(runs):
    done = launch([Job("stock", scenario="skip-block", steps=40), Job("guarded", scenario="skip-block", steps=40,
                                                                       guard=True)], runs / "alternating")
    stock, guarded = done.result("stock"), done.result("guarded")
    # Two orders, two recordings; every later departure is served by a recorded trace.
    assert guarded["trace"]["recordings"] == 2 and guarded["trace"]["cached"] == 2
    assert guarded["trace"]["switches"] >= 37
    assert [d["step"] for d in guarded["divergences"]] == [2]  # one warning, before both orders are known
    assert compare.first_loss_difference(stock["losses"], guarded["losses"]) is None
    assert compare.first_tensor_difference(done.state("stock"), done.state("guarded")) is None


def test_routed_order_resyncs_by_position_and_stays_bit_identical(runs):
    """Every step runs a new combination of experts: no recorded trace agrees with a whole step, so
    the step continues on one that ran the same expert at the same position."""
    done = launch([Job("stock", scenario="moe", steps=40), Job("guarded", scenario="moe", steps=40, guard=True)],
                  runs / "routed")
    stock, guarded = done.result("stock"), done.result("guarded")
    assert stock["crash"] is None and guarded["crash"] is None
    trace = guarded["trace"]
    assert trace["resyncs"] >= 60 and trace["switches"] > trace["resyncs"]  # most departures served
    assert trace["recordings"] <= 12  # recording only while some (layer, expert) was never seen
    assert max(d["step"] for d in guarded["divergences"]) <= 15  # then no more warnings
    assert compare.first_loss_difference(stock["losses"], guarded["losses"]) is None
    assert compare.first_tensor_difference(done.state("stock"), done.state("guarded")) is None


def test_memory_stays_flat_over_200_steps_of_changing_order(runs):
    """Routing: a new order every step, the trace cache (8 traces) full and evicting all along."""
    done = launch([Job("long", scenario="moe", steps=200, guard=True, track_memory=50)], runs / "long")
    for rank in (0, 1):
        rss = {int(k): v for k, v in done.result("long", rank)["rss"].items()}
        growth = rss[200] - rss[50]
        assert growth < 4 * 2**20, f"rank {rank}: RSS grew {growth / 2**20:.1f} MiB from step 50 to 200"


def test_divergence_records_stay_bounded_over_a_long_run(caplog):
    """A model that diverges on every step must not grow the records with the run: the first
    Diagnostics.KEPT are kept whole, all are counted, each distinct one warned about once."""
    diagnostics = Diagnostics()
    for step in range(3 * Diagnostics.KEPT):
        diagnostics.add(Divergence("order", step, "blocks.1", expected="blocks.2", cause="routing"))
    assert len(diagnostics.divergences) == Diagnostics.KEPT
    assert sum(diagnostics.counts.values()) == 3 * Diagnostics.KEPT
    assert len([r for r in caplog.records if r.name == "z3guard"]) == 1
    assert f"{3 * Diagnostics.KEPT}x" in diagnostics.summary()
