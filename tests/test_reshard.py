"""A ZeRO-3 checkpoint saved on N ranks resumes on M under z3guard, with no conversion: right after the
load every gathered tensor of the model and the optimizer equals the one at the save, bit for bit, and
training goes on within a stated tolerance of the uninterrupted run. Stock DeepSpeed refuses the load.
Both offloads (Hugging Face's ZeRO-3 example), DeepSpeed 0.19.8, gloo."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from z3guard.cli import app
from z3guard.scenarios import verify
from z3guard.scenarios.job import Job
from z3guard.scenarios.launch import rank_env, run_jobs

from .conftest import LAUNCH_TIMEOUT

# Fewer ranks and more, one precision each; Z3GUARD_MATRIX=full runs every direction in both.
CASES = [(2, 1, "fp16"), (2, 4, "bf16")]
if os.environ.get("Z3GUARD_MATRIX") == "full":
    CASES = [(n, m, d) for n, m in ((2, 1), (1, 2), (2, 4), (4, 2)) for d in ("fp16", "bf16")]


@pytest.mark.parametrize("n,m,dtype", CASES, ids=[f"{n}to{m}-{d}" for n, m, d in CASES])
def test_a_checkpoint_saved_on_n_ranks_resumes_on_m(runs, n, m, dtype):
    result = verify.run(verify.VerifyPlan(scenario="tied", nproc=n, resume_ranks=m, dtype=dtype,
                                          out=runs / f"reshard-{n}to{m}"))
    assert result.failure is None and result.crash is None, result.failure or result.crash
    assert result.identical and result.status == 0, str(result.difference)
    assert result.checked[0].startswith(f"state right after the load on {m} ranks == at the save on {n}")
    assert [step for step, _, _ in result.losses] == [5, 6, 7, 8] and result.tolerance == 5e-3


def test_stock_refuses_it_and_bad_checkpoints_are_refused_before_loading(runs, tmp_path):
    """On 1 rank, of the checkpoint saved on 2: stock DeepSpeed's refusal; z3guard's, naming the file, when a
    rank's partitions are missing; and naming the parameter, when the model's shapes differ."""
    saved = runs / "reshard-2to1" / "checkpoint"
    if not saved.is_dir():
        pytest.skip("needs the 2 -> 1 case's checkpoint")
    partial = tmp_path / "partial"
    shutil.copytree(saved, partial)
    gone = next(partial.glob("*/zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    gone.unlink()
    universal = tmp_path / "universal"  # DeepSpeed's own way stays DeepSpeed's under z3guard
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(saved / "step4"), "--output_folder", str(universal / "step4")], check=True,
                   capture_output=True, env=rank_env("cpu"))
    (universal / "latest_universal").write_text("step4")
    lm = dict(batch="z3guard.scenarios.catalog:_token_batch", hidden=64, steps=6)
    jobs = [Job("partial", scenario="tied", guard=True, load_dir=str(partial), steps=6),
            Job("shapes", model="tests.scripts.user_models:narrow_lm", guard=True, load_dir=str(saved), **lm),
            Job("universal", scenario="tied", guard=True, load_dir=str(universal), steps=6,
                config={"checkpoint": {"load_universal": True}}),
            Job("stock", scenario="tied", load_dir=str(saved), steps=6)]  # last: its refusal ends the ranks
    done = run_jobs(jobs, tmp_path / "launch", nproc=1, timeout=LAUNCH_TIMEOUT)
    assert f"{gone}: missing" in done.result("partial")["load_error"]
    assert ("parameter 'embed.weight' is (64, 32) in the model, (64, 64) in the checkpoint"
            in done.result("shapes")["load_error"])
    res = done.result("universal")
    assert res["crash"] is None and "load_error" not in res and res["start"] == 4, res
    assert done.log.count("re-partitioning it for 1") == 0
    stock = done.failure("stock")
    assert "used a DP world size of 2 but the current world size is 1" in stock["summary"], stock

    from z3guard.checkpoint.state import _derived

    draws = {}  # a rank past the saved ones: streams of its own, the same on every resume
    for rank in (2, 2, 3):
        state = _derived(torch.load(saved / "step4" / "z3guard_state_rank0.pt", weights_only=False), rank)
        generator = torch.Generator()
        generator.set_state(state["torch_rng"])
        draws.setdefault(rank, set()).add(torch.rand(1, generator=generator).item())
    assert len(draws[2]) == 1 and draws[2] != draws[3]

    result = CliRunner().invoke(app, ["check-checkpoint", str(saved), "--json", str(tmp_path / "c.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "c.json").read_text())["loads_on"].startswith("any number of ranks under z3guard")
