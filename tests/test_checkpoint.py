"""Atomic, checksummed, verified checkpoints; exact resume; faults and bad input."""
from __future__ import annotations

import os
import shutil

import pytest
from typer.testing import CliRunner

from z3guard.checkpoint import CheckpointError, manifest
from z3guard.checkpoint.faults import POINTS, WRITE_BACK
from z3guard.cli import app
from z3guard.scenarios import compare, verify
from z3guard.scenarios.job import Job
from z3guard.scenarios.launch import run_jobs

from .conftest import LAUNCH_TIMEOUT, launch


# -- exact resume ----------------------------------------------------------------------------
# The CLIP-style attention pooling with a skipped step: tests/test_doctor.py, through the command line.
@pytest.mark.parametrize("scenario,skip_at", [("tied", (5, 6))])
def test_verify_resume_is_bit_identical_with_skipped_steps(runs, scenario, skip_at):
    result = verify.run(verify.VerifyPlan(scenario=scenario, skip_at=skip_at, out=runs / f"verify-{scenario}"))
    assert result.crash is None
    assert result.identical, str(result.difference)
    assert "saved data position" in result.checked and "RNG streams (python, numpy, torch)" in result.checked


def test_verify_resume_catches_what_stock_deepspeed_loses(runs):
    """Without z3guard the same comparison fails: DeepSpeed does not save the RNG streams."""
    result = verify.run(verify.VerifyPlan(scenario="tied", skip_at=(), guard=False, out=runs / "verify-stock"))
    assert not result.identical
    assert "RNG streams" in result.difference.where


# -- a good checkpoint, then every fault ------------------------------------------------------
@pytest.fixture(scope="module")
def saved(runs):
    """A guarded run that saved after steps 2 and 3 (tags step2, step3)."""
    root = runs / "ckpt-good"
    first = launch([Job("save", guard=True, steps=3, save_at=[2, 3], save_dir=str(root)),
                    Job("init", guard=True, steps=0)], runs / "ckpt-good-launch")
    return root, first


def test_save_is_published_whole_with_a_manifest(saved):
    root, _ = saved
    assert (root / "latest").read_text() == "step3"
    assert not (root / ".z3guard-staging").exists()
    assert (root / "zero_to_fp32.py").is_file()  # DeepSpeed's recovery script lands where stock puts it
    m = manifest.verify(root / "step3", world_size=2, zero_stage=3, dtype="fp16")
    assert m.global_step == 3 and m.world_size == 2 and m.deepspeed and m.torch
    assert {"z3guard_state_rank0.pt", "z3guard_state_rank1.pt"} <= set(m.files)
    assert any(name.endswith("optim_states.pt") for name in m.files)


def _corrupt(root, tmp_path, how):
    bad = tmp_path / how
    shutil.copytree(root, bad)
    shard = next(p for p in sorted((bad / "step3").iterdir()) if p.name.endswith("optim_states.pt"))
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "flipped":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif how == "missing-file":
        shard.unlink()
    elif how == "missing-latest":
        (bad / "latest").unlink()
    return bad, shard.name


@pytest.mark.parametrize("how,expected", [
    ("truncated", "bytes, the manifest says"),
    ("flipped", "(corrupted)"),
    ("missing-file", "missing (listed in the manifest"),
])
def test_bad_files_are_named(saved, tmp_path, how, expected):
    bad, shard = _corrupt(saved[0], tmp_path, how)
    with pytest.raises(CheckpointError) as err:
        manifest.verify(bad / "step3", world_size=2)
    assert shard in str(err.value) and expected in str(err.value)


def test_wrong_world_size_names_the_field_and_the_way_out(saved):
    with pytest.raises(CheckpointError) as err:
        manifest.verify(saved[0] / "step3", world_size=4)
    msg = str(err.value)
    assert "'world_size' is 2, this job expects 4" in msg and "ds_to_universal" in msg


def test_a_refused_load_loads_nothing(saved, runs, tmp_path):
    """Real engines: each bad checkpoint is refused on both ranks before DeepSpeed reads it."""
    root, first = saved
    cases = {how: _corrupt(root, tmp_path, how)[0] for how in ("flipped", "missing-latest")}
    second = launch([Job(f"load-{how}", guard=True, steps=4, load_dir=str(path)) for how, path in cases.items()],
                    runs / "refused-loads")
    for how in cases:
        for rank in (0, 1):
            res = second.result(f"load-{how}", rank)
            assert "load_error" in res, f"{how}: rank {rank} loaded a bad checkpoint"
        assert compare.first_tensor_difference(first.state("init"), second.state(f"load-{how}")) is None
    assert "latest: missing" in second.result("load-missing-latest")["load_error"]
    assert "(corrupted)" in second.result("load-flipped")["load_error"]


def test_a_checkpoint_written_without_z3guard_still_loads(runs):
    root = runs / "ckpt-stock"
    launch([Job("stock-save", steps=2, save_at=[2], save_dir=str(root))], runs / "stock-save")
    second = launch([Job("guarded-load", guard=True, steps=3, load_dir=str(root))], runs / "stock-load")
    res = second.result("guarded-load")
    assert res["start"] == 2 and res["crash"] is None and "load_error" not in res
    assert "has no z3guard-manifest.json (written without z3guard): loading it unverified" in second.log


def test_saving_a_tag_again_replaces_it_whole(runs):
    """DeepSpeed lets a tag be saved again (its own tests do); z3guard replaces it atomically."""
    root = runs / "ckpt-same-tag"
    first = launch([Job("twice", guard=True, steps=3, save_at=[2, 3], save_tag="fixed", save_dir=str(root))],
                   runs / "same-tag")
    assert "save_error" not in first.result("twice")
    assert manifest.verify(root / "fixed", world_size=2).global_step == 3
    assert not (root / ".z3guard-staging").exists()


def test_two_saves_of_one_tag_at_once_are_refused_and_the_old_one_kept(runs):
    """A live save of the same tag (another process holds its lock) makes this one refuse."""
    import os

    root = runs / "ckpt-concurrent"
    (root / ".z3guard-staging").mkdir(parents=True)
    (root / ".z3guard-staging" / "step3.lock").write_text(str(os.getpid()))  # this test process: alive
    first = launch([Job("busy", guard=True, steps=3, save_at=[2, 3], save_dir=str(root))], runs / "concurrent")
    err = first.result("busy")["save_error"]
    assert f"another save of checkpoint 'step3' is in progress (process {os.getpid()})" in err
    assert (root / "latest").read_text() == "step2" and not (root / "step3").exists()
    manifest.verify(root / "step2", world_size=2)


def test_a_failing_write_publishes_nothing(runs):
    """Writes fail past a size limit (RLIMIT_FSIZE) as on a full disk, from the second save on."""
    root = runs / "ckpt-full"
    first = launch([Job("full", guard=True, steps=3, save_at=[2, 3], fsize_limit=200_000, save_dir=str(root))],
                   runs / "full")
    err = first.result("full")["save_error"]
    assert "saving checkpoint 'step3'" in err and "'latest' still points to 'step2'" in err
    assert (root / "latest").read_text() == "step2" and not (root / "step3").exists()
    manifest.verify(root / "step2")


def test_a_failing_save_of_a_tag_again_keeps_the_old_one_where_stock_loses_it(runs):
    """The failure without z3guard: stock DeepSpeed writes into the published tag, so a write failing
    part-way (a full disk) raises and leaves `latest` pointing at torn files; z3guard's staged save fails
    cleanly and keeps the old ones."""
    import torch

    for guard in (False, True):
        name = "z3guard" if guard else "stock"
        root = runs / f"ckpt-resave-{name}"
        saving = run_jobs([Job("full", guard=guard, steps=3, save_at=[2, 3], save_tag="fixed", fsize_limit=200_000,
                               save_dir=str(root))], runs / f"resave-{name}", timeout=LAUNCH_TIMEOUT)
        assert (root / "latest").read_text() == "fixed"
        if guard:
            assert saving.returncode == 0 and "save_error" in saving.result("full")
            loaded = launch([Job("load", guard=True, steps=4, load_dir=str(root))], runs / f"resave-{name}-load")
            res = loaded.result("load")
            assert res["start"] == 2 and "load_error" not in res and res["crash"] is None
            assert manifest.verify(root / "fixed", world_size=2).global_step == 2
        else:  # stock's save raised out of `save_checkpoint`, which ends the ranks; step 2's states are gone
            assert saving.returncode != 0 and "save_checkpoint raised" in saving.log
            with pytest.raises(RuntimeError, match="central directory"):  # rank 0 truncated its own file
                torch.load(root / "fixed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)


def test_a_write_failing_on_one_rank_ends_stocks_run_and_only_fails_z3guards_save(runs):
    """The failure without z3guard's agreement between ranks: in stock DeepSpeed rank 1's full disk raises
    on rank 1 alone, which ends the run and leaves a torn `step3` in the folder (and, when rank 0 gets
    that far before it is stopped, `latest` pointing at it). z3guard fails that save on both ranks alike,
    with the same error to handle, and publishes nothing."""
    import torch

    for guard in (False, True):
        name = "z3guard" if guard else "stock"
        root = runs / f"ckpt-one-rank-{name}"
        saving = run_jobs([Job("full", guard=guard, steps=3, save_at=[2, 3], fsize_limit=200_000, fsize_rank=1,
                               save_dir=str(root))], runs / f"one-rank-{name}", timeout=LAUNCH_TIMEOUT)
        if guard:
            assert saving.returncode == 0
            for rank in (0, 1):
                res = saving.result("full", rank)
                assert "rank 1: " in res["save_error"] and res["crash"] is None
            assert (root / "latest").read_text() == "step2" and not (root / "step3").exists()
            manifest.verify(root / "step2", world_size=2)
        else:
            assert saving.returncode != 0 and "save_checkpoint raised" in saving.log  # rank 1's error
            with pytest.raises(RuntimeError, match="central directory"):  # rank 1's file: torn
                torch.load(root / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)


# Z3GUARD_MATRIX=full kills at every point; the main suite at one of each phase: writing, before the rename
# that publishes, before `latest` moves, and after the save returned, while its files go to disk.
KILL_POINTS = (POINTS if os.environ.get("Z3GUARD_MATRIX") == "full" else
               ("mid-data", "before-rename", "before-latest")) + (WRITE_BACK,)


def test_kill_at_every_point_of_a_save_keeps_the_previous_checkpoint(runs):
    """Killed before it is published, a save leaves the previous checkpoint and `latest` as they were.
    Killed after (rank 0 dies while its files are still being synced, as its process exits), the page
    cache finishes the write-back: the new checkpoint is whole and the resume starts from it."""
    roots = {p: runs / f"kill-{p}" for p in KILL_POINTS}
    kept = {p: "step3" if p == WRITE_BACK else "step2" for p in KILL_POINTS}
    for point, root in roots.items():
        killed = run_jobs([Job("save", guard=True, steps=3, save_at=[2, 3], save_dir=str(root))],
                          runs / f"kill-{point}-launch", timeout=LAUNCH_TIMEOUT,
                          env={"Z3GUARD_KILL_AT": f"{point}@step3"})
        assert killed.returncode != 0, f"{point}: the rank was not killed"
        assert (root / "latest").read_text() == kept[point], point
        manifest.verify(root / kept[point], world_size=2)
    resumed = launch([Job(f"resume-{p}", guard=True, steps=4, load_dir=str(r)) for p, r in roots.items()],
                     runs / "kill-resume")
    for point in KILL_POINTS:
        res = resumed.result(f"resume-{point}")
        assert res["start"] == int(kept[point][-1]) and res["crash"] is None and "load_error" not in res, point


def test_a_disk_error_after_publishing_fails_the_next_save_on_every_rank(runs):
    """A save is published before its files are on disk (stock's save returns at that point too, and never
    hears of the write-back). An error the disk reports for it later, on one rank, fails the next save on
    both ranks, naming the checkpoint; nothing of the next one is published."""
    root = runs / "ckpt-write-back-error"
    run = run_jobs([Job("eio", guard=True, steps=3, save_at=[2, 3], save_dir=str(root))],
                   runs / "write-back-error", timeout=LAUNCH_TIMEOUT, env={"Z3GUARD_FAIL_AT": f"{WRITE_BACK}@step2:1"})
    assert run.returncode == 0, run.log[-4000:]
    for rank in (0, 1):
        err = run.result("eio", rank)["save_error"]
        assert "rank 1: the disk reported an error writing checkpoint 'step2' back after it was published" in err
        assert "injected I/O error" in err and "durable_saves=on" in err
    assert (root / "latest").read_text() == "step2" and not (root / "step3").exists()


def test_check_checkpoint_cli(saved, tmp_path):
    runner = CliRunner()
    good = runner.invoke(app, ["check-checkpoint", str(saved[0])])
    assert good.exit_code == 0 and "verified" in good.output and "world_size" in good.output
    bad, shard = _corrupt(saved[0], tmp_path, "flipped")
    failed = runner.invoke(app, ["check-checkpoint", str(bad)])
    assert failed.exit_code == 1 and "hash" in failed.output and "FAILED" in failed.output


def test_a_read_only_folder_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """As root (CI), permission bits do not stop writes, so the check is exercised through os.access."""
    import os

    from z3guard.checkpoint.engine import _target_problem

    root = tmp_path / "ckpts"
    root.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    problem = _target_problem(root, root / "step9")
    assert problem == f"{root}: not writable, cannot save checkpoint 'step9' there."
    assert list(root.iterdir()) == []


def test_a_save_lock_is_held_only_by_a_live_process_of_this_host(tmp_path):
    """A requeued job on another host may find a lock whose pid is alive here by chance: not a holder."""
    import os
    import socket

    from z3guard.checkpoint.engine import _claim

    lock = tmp_path / "step3.lock"
    for text, refused in ((f"{socket.gethostname()}:{os.getppid()}", True), (str(os.getppid()), True),
                          (f"other-host:{os.getppid()}", False), (f"{socket.gethostname()}:{os.getpid()}", False)):
        lock.write_text(text)
        problem = _claim(tmp_path, "step3")
        assert (problem is not None) == refused, text
        if refused:
            assert f"(process {os.getppid()})" in problem


def test_the_way_out_stock_deepspeed_and_zero_to_fp32_read_a_z3guard_checkpoint(runs):
    """Uninstalling z3guard loses nothing: stock DeepSpeed, with z3guard absent, loads what z3guard saved to
    the same weights and fp32 masters, and DeepSpeed's own `zero_to_fp32` converts it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = runs / "ckpt-way-out"
    first = launch([Job("guarded-save", guard=True, steps=2, save_at=[2], save_dir=str(root))], runs / "way-out-save")
    second = launch([Job("stock-load", steps=2, load_dir=str(root))], runs / "way-out-load")
    res = second.result("stock-load")
    assert res["start"] == 2 and res["crash"] is None and "load_error" not in res
    saved = first.state("guarded-save")
    assert compare.first_tensor_difference(saved, second.state("stock-load")) is None
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(root))
    masters = {k.removeprefix("master/"): v for k, v in saved.items() if k.startswith("master/")}
    assert masters and set(fp32) >= set(masters)
    assert compare.first_tensor_difference(masters, {k: fp32[k].float() for k in masters}) is None


# -- a disk per node ---------------------------------------------------------------------------
def test_a_folder_per_node_commits_each_and_resumes_exactly(runs):
    """Each rank saves into its own folder, as onto a disk per node: each stages and commits its own files
    under a manifest of them, `latest` is written into every folder, and the resume equals the run that went
    on. Stock DeepSpeed writes `latest` from rank 0 alone, so rank 1's folder has none to resume from."""
    import re

    root = runs / "per-node"
    run = launch([Job("stock", steps=2, save_at=[2], save_dir=str(root / "stock{rank}")),
                  Job("through", guard=True, steps=5, save_at=[3], save_dir=str(root / "node{rank}"),
                      options={"durable_saves": True}),  # each save on disk before it is published
                  Job("resumed", guard=True, steps=5, load_dir=str(root / "node{rank}"))], runs / "per-node-launch")
    assert (root / "stock0" / "latest").is_file() and not (root / "stock1" / "latest").exists()
    for r in (0, 1):
        node = root / f"node{r}"
        assert (node / "latest").read_text() == "step3" and not (node / ".z3guard-staging").exists()
        m = manifest.verify(node / "step3", world_size=2)
        assert (m.storage, m.storages) == (r, 2)
        assert m.files and all(re.search(rf"rank_?{r}\D", n) for n in m.files), sorted(m.files)
        shown = CliRunner().invoke(app, ["check-checkpoint", str(node)])
        assert shown.exit_code == 0 and f"{r + 1} of 2" in shown.output, shown.output
    through, resumed = run.result("through"), run.result("resumed")
    assert resumed["start"] == 3 and "load_error" not in resumed and resumed["crash"] is None
    assert resumed["losses"] and all(through["losses"][k] == v for k, v in resumed["losses"].items())
    assert compare.first_tensor_difference(run.state("through"), run.state("resumed")) is None


def test_a_folder_per_node_moves_latest_only_when_every_node_committed(runs):
    """Rank 1's disk fills during the second save: neither folder gets that checkpoint or a new `latest`."""
    root = runs / "per-node-full"
    first = launch([Job("full", guard=True, steps=3, save_at=[2, 3], fsize_limit=200_000, fsize_rank=1,
                        save_dir=str(root / "node{rank}"))], runs / "per-node-full-launch")
    for r in (0, 1):
        assert "rank 1: " in first.result("full", r)["save_error"]
        assert (root / f"node{r}" / "latest").read_text() == "step2" and not (root / f"node{r}" / "step3").exists()
        manifest.verify(root / f"node{r}" / "step2", world_size=2)
