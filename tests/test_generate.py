"""generate() between training steps, as TRL's GRPO/RLOO/online-DPO trainers run it (real DeepSpeed ZeRO-3,
transformers Llama, peft LoRA, DeepSpeed's unwrap_model_for_generation, 2 gloo ranks; tests/scripts/
generate_train.py). Runs on the main release and, through tests/releases.py, on the releases where stock
fails:

- DeepSpeed 0.15.4-0.19.1: registering the hooks again on leaving `unwrap_model_for_generation` numbers every
  module anew, and the next training forward raises `IndexError: pop from an empty deque`;
- DeepSpeed before 0.19.5 (from 0.15.3 at least): with non-reentrant gradient checkpointing over the frozen
  base weights the first backward's recompute finds a LoRA layer's weights released
  (torch.utils.checkpoint.CheckpointError).

From 0.19.5 the checkpointed case also trains peft's `modules_to_save` (a copy of the output projection).
Before 0.19.5 stock and z3guard both fail there at the first forward (`AttributeError: 'Linear' object has
no attribute 'ds_grads_remaining'`): peft's wrapper hands attribute reads to the module it wraps, so
DeepSpeed takes the wrapped module's backward-hook state for the wrapper's and gives the wrapper none. That
is hook registration, not the trace; z3guard does not change it.

z3guard completes both, with results bit-identical to stock's known workaround (TRL >= 1.5's trace
invalidation) and to stock where stock completes; checkpointing changes no result.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import deepspeed
import pytest
from deepspeed.runtime.zero import stage3
from packaging.version import Version

from z3guard.scenarios.launch import run_ranks

from .conftest import LAUNCH_TIMEOUT

if not hasattr(stage3, "unwrap_model_for_generation"):
    pytest.skip("this release has no unwrap_model_for_generation", allow_module_level=True)
SCRIPT = Path(__file__).parent / "scripts" / "generate_train.py"
RELEASE = Version(deepspeed.__version__.split("+")[0])
RENUMBERING_FAILS = Version("0.15.4") <= RELEASE < Version("0.19.2")
RECOMPUTE_FAILS = RELEASE < Version("0.19.5") if RELEASE >= Version("0.15.3") else None  # older: not known
MODULES_TO_SAVE = ["--modules-to-save"] if RELEASE >= Version("0.19.5") else []  # before: fails with or without z3guard
CASES = {"generate": [], "checkpointing": ["--checkpointing", *MODULES_TO_SAVE]}


@pytest.fixture(scope="module")
def runs_of(runs):
    out = runs / "generate"
    out.mkdir()
    done = {}
    for case, flags in CASES.items():
        modes = ["stock", "guarded"] + (["workaround"] if case == "generate" and RENUMBERING_FAILS else [])
        for mode in modes:
            folder = out / case
            launched = run_ranks([str(SCRIPT), str(folder), mode, *flags], folder / f"launch-{mode}",
                                 timeout=LAUNCH_TIMEOUT)
            assert launched.returncode == 0, launched.log[-5000:]
            done[case, mode] = [json.loads((folder / f"{mode}.rank{r}.json").read_text()) for r in (0, 1)]
    return done


def _same(a: list[dict], b: list[dict]) -> None:
    for rank in (0, 1):
        for key in ("losses", "generated", "adapters"):
            assert a[rank][key] == b[rank][key], (rank, key)


def test_stock_fails_where_the_release_has_the_bug(runs_of):
    for rank in (0, 1):
        plain, checkpointed = runs_of["generate", "stock"][rank], runs_of["checkpointing", "stock"][rank]
        if RENUMBERING_FAILS:
            assert plain["crash"] == "IndexError: pop from an empty deque", plain["crash"]
            assert list(plain["losses"]) == ["1"]  # the first training forward after a generate()
        else:
            assert plain["crash"] is None
        if RECOMPUTE_FAILS is None:
            continue
        if RECOMPUTE_FAILS:
            assert checkpointed["crash"].startswith("CheckpointError: torch.utils.checkpoint: Recomputed values")
            assert checkpointed["losses"] == {}  # the first step's backward
        else:
            assert checkpointed["crash"] is None


@pytest.mark.parametrize("case", list(CASES))
def test_z3guard_completes_with_the_results_of_a_run_that_works(runs_of, case):
    guarded = runs_of[case, "guarded"]
    assert [r["crash"] for r in guarded] == [None, None]
    assert list(guarded[0]["losses"]) == ["1", "2", "3", "4", "5"]
    # generate() runs with the hooks removed: its reads are nobody's cross-module reads (taken for the root's,
    # or for those of a module a checkpoint recompute left on DeepSpeed's stack, they would make that module
    # gather the whole model first). What stays is peft's LoRA layer reading its own adapter's dtype.
    reads = re.findall(r"^  read +(\S+) reads (\S+)", guarded[0]["summary"], re.MULTILINE)
    assert all(reader != "<root>" and param.startswith(reader + ".lora_A.") for reader, param in reads), reads
    if "--modules-to-save" in CASES[case]:  # another model: stock, which completes it on these releases
        _same(guarded, runs_of[case, "stock"])
    else:  # checkpointing recomputes the same arithmetic: the same bits as the run without it
        _same(guarded, runs_of["generate", "workaround" if RENUMBERING_FAILS else "stock"])
