"""Issue 8: the host optimizer step behind the next forward (adapter/overlap.py) gives stock's bytes."""
from __future__ import annotations

from z3guard.adapter.overlap import _gaps
from z3guard.scenarios import compare
from z3guard.scenarios.job import Job

from .conftest import launch


def test_overlapped_host_step_is_bit_identical_over_52_steps_with_skips_and_reads_between_steps(runs, tmp_path):
    """DeepSpeedCPUAdam on both offloads, several sub-groups: each step's pass runs on the worker while
    the next forward gathers; between steps a GatheredParameters read, an eval forward, an explicit
    partition and a checkpoint save each read what the pass writes, right after `step` returned."""
    ds_adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "zero_optimization": {"sub_group_size": 5000}}
    skips = [3, 10, 25, 26, 40]
    events = {"5": ["gathered"], "11": ["eval"], "12": ["partition"], "26": ["gathered"], "33": ["eval", "gathered"]}
    common = dict(steps=52, skip_at=skips, config=ds_adam, events=events)
    done = launch([Job("stock", save_at=[20], save_dir=str(tmp_path / "stock"), **common),
                   Job("overlap", guard=True, options={"host_threads": 2}, save_at=[20],
                       save_dir=str(tmp_path / "overlap"), **common),
                   Job("sync", guard=True, options={"host_threads": 2, "overlap_host_step": False}, **common)],
                  runs / "overlap")
    stock, over, sync = (done.result(n) for n in ("stock", "overlap", "sync"))
    assert "overlap_step" in over["fast_paths"] and "overlap_step" not in sync["fast_paths"]
    assert over["optimizer_sub_groups"] >= 3
    assert stock["skipped"] == over["skipped"] == sync["skipped"] == skips
    # every applied step handed its pass to the worker (the persistent parameters' regions ran in `step`)
    assert over["host_step"]["steps"] == 52 - len(skips) and over["host_step"]["deferred_elements"] > 0
    assert over["host_step"]["gather_waits"] > 0  # the reads right after `step` found the pass still running
    for name in ("overlap", "sync"):  # losses, weights, both ranks' optimizer states
        diff = compare.first_job_difference(done, "stock", name)
        assert diff is None, f"{name}: {diff}"


def test_gaps_cover_what_the_priority_ranges_leave():
    assert _gaps([], 10) == [(0, 10)]
    assert _gaps([(0, 128), (256, 384)], 500) == [(128, 256), (384, 500)]
    assert _gaps([(0, 500)], 500) == []
