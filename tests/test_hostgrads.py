"""The fp32 gradients cast on the host where read (adapter/hostgrads.py) give stock's bytes to
every reader."""
from __future__ import annotations

import torch

from z3guard.scenarios import compare
from z3guard.scenarios.job import Job

from .conftest import launch


def test_fp32_gradients_cast_on_the_host_read_as_stocks_through_deepspeeds_accessors(runs):
    """Real ZeRO-3 with DeepSpeedCPUAdam: the fp32 gradients are never copied to the host in full (the fused
    step casts them from the fp16 regions), yet `safe_get_full_grad` before a step, after it (a step's
    noted gradients, unscaled), after a skipped one, `safe_set_full_grad` between backward and step,
    losses, weights and optimizer states are stock's. Also: a block without gradients on odd steps (its
    notes from the step before are stale there), and two micro-steps per step (nothing noted)."""
    ds_adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "zero_optimization": {"sub_group_size": 5000}}
    clip = dict(steps=14, skip_at=[3, 9], config=ds_adam,
                grads={"2": ["before"], "3": ["after"], "4": ["halve", "after"], "5": ["after"],
                       "9": ["before", "halve"], "10": ["after"], "13": ["before", "halve", "after"]})
    skipping = dict(scenario="skip-block", steps=10, config=ds_adam,
                    grads={"4": ["after"], "5": ["after"], "8": ["before"]})
    accumulating = dict(steps=6, grad_accum=2, skip_at=[3], config=ds_adam, grads={"4": ["before", "after"]})
    jobs = [Job(f"{name}-{kind}", guard=kind == "fast", **common) for kind in ("stock", "fast")
            for name, common in (("clip", clip), ("skip", skipping), ("accum", accumulating))]
    done = launch(jobs, runs / "host-grads")
    fast = done.result("clip-fast")
    assert "grads_cast_on_host" in fast["fast_paths"]
    moved = fast["grad_offload"]
    assert moved["cast_on_host"] == moved["from_device"] > 0
    assert fast["overflow_reads"] == {"checks": 14, "elements_read": 0}  # the norms still decide it
    assert fast["grads_written"]["for_readers"] > 0
    assert done.result("skip-fast")["grads_written"]["stale"] > 0
    assert done.result("accum-fast")["grad_offload"]["cast_on_host"] == 0
    assert any(k.startswith("grad/5/after/") for k in done.state("clip-fast"))
    for name in ("clip", "skip", "accum"):
        diff = compare.first_job_difference(done, f"{name}-stock", f"{name}-fast")
        assert diff is None, f"{name}: {diff}"


def test_noted_gradients_merge_into_runs_where_memory_is_contiguous():
    """hostgrads.runs_for_step: one slice per stretch that is contiguous both in the fp32 gradient and in
    the host buffer; a note a step already used is written to memory first (times its factor)."""
    from types import SimpleNamespace

    from z3guard.adapter import hostgrads

    buffer = torch.arange(20, dtype=torch.float16)
    flat = SimpleNamespace(grad=torch.zeros(20))
    params = [SimpleNamespace(ds_id=i) for i in range(5)]
    spans = [(0, 4), (4, 8), (8, 12), (14, 20), (12, 14)]  # the last: elsewhere in the buffer
    opt = SimpleNamespace(fp32_partitioned_groups_flat=[flat], get_param_id=lambda p: p.ds_id,
                          grad_position={i: (0, a, b - a) for i, (a, b) in enumerate(spans)},
                          z3guard_lazy={}, z3guard_lazy_written={"for_readers": 0, "stale": 0})
    sources = [buffer[0:4], buffer[4:8], buffer[8:12], buffer[12:18], buffer[18:20]]
    for p, src in zip(params, sources):
        hostgrads.defer(opt, p, src)
    hostgrads.stepped(opt, 0, 0.5)
    hostgrads.defer(opt, params[0], sources[0])  # noted again by the next backward; 1-4 are now stale
    hostgrads.defer(opt, params[1], sources[1])
    runs = hostgrads.runs_for_step(opt, 0)
    assert [(r.start, r.end) for r in runs] == [(0, 8)] and torch.equal(runs[0].source, buffer[0:8])
    assert opt.z3guard_lazy_written["stale"] == 3
    want = torch.zeros(20)
    for (a, b), src in list(zip(spans, sources))[2:]:
        want[a:b] = src.float() * 0.5
    assert torch.equal(flat.grad, want)


def test_every_reader_of_the_fp32_gradients_is_known():
    """hostgrads keeps the fp32 gradients as their fp16 regions until something reads them: every method of
    DeepSpeed's stage 3 that touches them, or the regions, must be one it makes them real before, or one
    that cannot run beside it. A new DeepSpeed release that adds one fails here, not in a user's run.
    (What goes through a listed method, as `set_fp32_grad_for_param` through `_get_fp32_grad_state_partition`,
    is covered by it; the accessors' test reads and writes through them.)"""
    import ast
    import inspect
    import re

    from deepspeed.runtime.zero import stage3

    from z3guard.adapter import hostgrads

    known = {  # methods touching the fp32 gradients
        **{name: "materialises first" for name in hostgrads.MATERIALISED_BEFORE
           if name != "finalize_gradient_accumulation_boundary"},  # which writes through the next one
        "unscale_and_clip_grads": "fusedstep materialises where stock's runs",
        "_offload_grad_partition_at_boundary": "the writer: materialised before each caller (gradoffload's, "
                                               "stock's partition_grads, finalize_gradient_accumulation_boundary)",
        "step": "reads them for Muon only (not fused)",
        "_apply_muon_updates_cpu_offload": "Muon (not fused)",
        "_prepare_fp32_grad_for_sub_group": "without offload_optimizer",
        "initialize_optimizer_states": "at construction",
        "_unpin_offload_buffers": "at destroy: the notes are dropped first",
        "_release_sub_group": "without offload_optimizer, or NVMe swap (not applied)",
        "_optimizer_states_and_gradient_swap_out": "NVMe swap (not applied)",
        "_release_swap_buffers": "NVMe swap (not applied)",
        "_writeback_swap_state": "NVMe swap (not applied)",
    }
    regions = {  # methods touching the fp16 regions the notes read
        "_setup_for_real_optimizer": "at construction",
        "partition_grads": "writes them: gradoffload materialises their notes before stock's runs",
        "_finalize_offload_gradient_accumulation": "through finalize_gradient_accumulation_boundary, which "
                                                   "materialises first",
        "independent_gradient_partition_epilogue": "without offload_optimizer",
        "has_overflow": "reads them",
        "_get_fp32_grad_state_partition": "materialises first",
        "update_fp32_grad_for_param_vectorized": "materialises first",
        "_unpin_offload_buffers": "at destroy: the notes are dropped first",
        "offload_states": "moves them (a note keeps its storage, whose values stay)",
        "reload_states": "moves them back (likewise)",
    }
    source = inspect.getsource(stage3.DeepSpeedZeroOptimizer_Stage3)
    methods = {f.name: ast.unparse(f) for f in ast.parse(source).body[0].body if isinstance(f, ast.FunctionDef)}
    found = {name for name, code in methods.items()  # code without comments
             if re.search(r"\.grad\b", code) and ("fp32_partitioned_groups_flat" in code or "fp32_param" in code)}
    touching = {name for name, code in methods.items()
                if "__param_id_to_grad_partition" in code or "grad_partitions_flat_buffer" in code}
    assert touching == set(regions), f"new: {sorted(touching - set(regions))}, gone: {sorted(set(regions) - touching)}"
    assert found == set(known), f"new: {sorted(found - set(known))}, gone: {sorted(set(known) - found)}"
