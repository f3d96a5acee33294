"""A guarded engine keeps stock DeepSpeed's save/load contract (beside stock engines, one gloo group),
fails whole where it fails, and is refused clearly where it cannot apply. Runs on every supported
release of the CPU matrix (tests/releases.py)."""
from __future__ import annotations

import json
from pathlib import Path

import deepspeed
import pytest

from z3guard.adapter.releases import speed_paths_on
from z3guard.scenarios.launch import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "engine_contract.py"


@pytest.fixture(scope="module")
def contract(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("contract")
    done = run_ranks([str(SCRIPT), str(out)], out, timeout=240)  # a rank left waiting shows as a timeout
    assert done.returncode == 0, done.log[-4000:]
    ranks = [json.loads((out / f"contract.rank{r}.json").read_text()) for r in (0, 1)]
    return ranks[0] | {"both": ranks}


@pytest.mark.parametrize("method", ["save_checkpoint", "load_checkpoint"])
def test_save_and_load_keep_deepspeeds_signatures(contract, method):
    """Trainer looks for `exclude_frozen_parameters` in the signature (else saves frozen weights too)."""
    stock, guarded = contract[f"signature/{method}"]
    assert guarded == stock


def test_the_engines_are_what_they_claim(contract):
    assert contract["guarded"] == [[], ["load_checkpoint", "save_checkpoint"]]


def test_positional_arguments_reach_deepspeed(contract):
    assert contract["save/positional"] == "ok: True" and contract["save/positional_manifest"]
    assert contract["load/positional"] == "ok: 1"  # the client state saved with it


def test_a_folder_without_checkpoints_loads_nothing_as_stock_does(contract):
    stock, guarded = contract["load/empty"]
    assert stock == guarded == "ok: (None, None)"


def test_a_weights_only_load_keeps_this_runs_rng_streams(contract):
    assert contract["load/module_only_keeps_rng"] and not contract["load/module_only_resumed_state"]
    assert contract["load/full_restores_rng"]


def test_set_data_position_refuses_an_engine_it_does_not_guard(contract):
    assert contract["set_data_position/stage0"].startswith("ValueError: z3guard.set_data_position: this engine "
                                                           "is not ZeRO stage 3")


def test_a_guard_that_fails_part_way_is_undone(contract):
    """Without strict, the failure is one warning and the engine trains as stock; with strict it raises.
    Either way nothing of the guard is left on the engine."""
    assert contract["guard/failing_lenient"] == "ok: None"
    assert contract["guard/lenient_still_works"] == "ok: None"
    assert contract["guard/failing"] == "RuntimeError: injected"
    assert contract["guard/rolled_back"] == {"own_save_load": [], "guarded_coordinators": [], "still_works": "ok: None"}


def test_fast_paths_failing_part_way_are_undone_with_the_rest(contract):
    if "persistent_gather" not in speed_paths_on(deepspeed.__version__):
        pytest.skip("no offload speed path is verified on this release")
    assert "overflow_check" in contract["guard/offload_fast_paths"]  # set before the one made to fail
    assert "persistent_gather" in contract["guard/offload_fast_paths"]
    assert contract["guard/failing_late"] == "RuntimeError: injected"
    assert contract["guard/late_rolled_back"] == {"optimizer_attributes": [], "own_save_load": [],
                                                  "still_works": "ok: None"}


def test_a_save_failing_on_one_rank_fails_on_every_rank_and_publishes_nothing(contract):
    for rank in contract["both"]:
        assert rank["save/one_rank_fails"].startswith("CheckpointError: saving checkpoint 'late'")
        assert "rank 1: [Errno 28] No space left on device (injected)" in rank["save/one_rank_fails"]
        assert "'latest' still points to 'pos'" in rank["save/one_rank_fails"]
    assert contract["save/latest_after_failure"] == "pos" and not contract["save/published_after_failure"]


def test_a_write_failing_inside_deepspeeds_save_on_one_rank_fails_on_every_rank(contract):
    """Rank 1's disk fills while DeepSpeed writes its optimizer file, between DeepSpeed's own collectives."""
    for rank in contract["both"]:
        error = rank["save/one_rank_disk_full"]
        assert error.startswith("CheckpointError: saving checkpoint 'full'")
        assert "rank 1: " in error and "Nothing was published" in error
    assert contract["save/latest_after_disk_full"] == "pos" and not contract["save/published_after_disk_full"]
