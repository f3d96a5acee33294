"""Issue 5: prefetch survives a module order that changes every step (a block skipped on odd steps;
routing that picks one of four experts per layer)."""
from __future__ import annotations

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


def test_memory_stays_flat_over_1000_steps_of_changing_order(runs):
    """Routing: a new order every step, the trace cache full and evicting all along."""
    done = launch([Job("long", scenario="moe", steps=1000, guard=True, track_memory=100)], runs / "long")
    for rank in (0, 1):
        rss = {int(k): v for k, v in done.result("long", rank)["rss"].items()}
        growth = rss[1000] - rss[200]
        assert growth < 8 * 2**20, f"rank {rank}: RSS grew {growth / 2**20:.1f} MiB from step 200 to 1000"
