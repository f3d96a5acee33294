"""The offload fast paths give the same bytes as stock DeepSpeed."""
from __future__ import annotations

import functools

import pytest
import torch

from z3guard.adapter.fastpaths import chunked_cast_copy_
from z3guard.adapter.overflow import any_nonfinite, nonfinite_gradients
from z3guard.adapter.hostthreads import launcher_left_one_thread
from z3guard.scenarios import compare
from z3guard.scenarios.job import Job

from .conftest import launch


def _awkward_values(n: int = 200_003) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=g) * s for s in (1e-8, 1e-3, 1.0, 1e3, 6e4)]
    parts.append(torch.tensor([65504.0, 65520.0, 7e4, -7e4, 6.1e-5, 5.96e-8, 2.98e-8, 0.0, -0.0,
                               float("inf"), float("-inf"), float("nan"), 1.0 + 2**-11, 1.0 + 3 * 2**-11]))
    parts.append(torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32).view(torch.float32))
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunked_cast_copy_matches_copy(dtype):
    src = _awkward_values()
    want = torch.empty(src.shape, dtype=dtype).copy_(src)
    got = torch.empty(src.shape, dtype=dtype)
    chunked_cast_copy_(got, src, chunk_numel=4099)  # the GPU path's chunking, run on the CPU
    same = (want.view(torch.int16) == got.view(torch.int16)) | (want.isnan() & got.isnan())
    assert bool(same.all())


@pytest.mark.parametrize("case", ["finite", "inf", "-inf", "nan", "sum-overflows"])
def test_nonfinite_check_is_exact(case):
    t = torch.randn(1_000_003, generator=torch.Generator().manual_seed(1))
    if case in ("inf", "-inf", "nan"):
        t[777_777] = float(case)
    if case == "sum-overflows":
        t[:10] = 3e38  # finite values whose sum is not: the exact check must decide
    stock = bool(torch.isinf(t).any() or torch.isnan(t).any())
    assert any_nonfinite(t, chunk_numel=65_536) == stock
    assert any_nonfinite(t, chunk_numel=65_536, on=torch.device("cpu")) == stock  # the GPU path's chunking
    half = t.clamp(-6e4, 6e4).half() if case == "finite" else t.half()  # fp16 training's buffer
    assert any_nonfinite(half, chunk_numel=65_536, on=torch.device("cpu")) == bool(~torch.isfinite(half).all())


def test_nonfinite_check_decides_fp16_buffers_from_the_sum(monkeypatch):
    """An fp16 sum of many gradients is past 65504: the sum must accumulate in fp32, else the exact
    (slow) check runs on every step."""
    t = torch.full((1_000_000,), 60_000.0, dtype=torch.float16)
    assert not torch.isfinite(t.sum())  # what a plain sum would have decided
    checked = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda x: checked.append(x.numel()) or isfinite(x))
    assert any_nonfinite(t) is False
    assert checked == [1]  # the sum alone decided


def test_lean_hooks_keep_stocks_behaviour_and_come_off_whole(monkeypatch):
    """The debug print still prints when asked to, NVTX ranges stay on where a profiler injected its tool,
    and `remove` gives every holder of `print_rank_0` DeepSpeed's function back (real DeepSpeed modules).
    The CUDA stream lookup applies to the CUDA accelerator only: measured and run on GPUs."""
    import sys

    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.utils import nvtx

    from z3guard.adapter import leanhooks

    stock = pp.print_rank_0
    holders = [m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get("print_rank_0") is stock]
    assert len(holders) >= 3  # the partitioner and its `import *` importers (coordinator, offload)
    printed = []
    monkeypatch.setattr(pp.dist, "get_rank", lambda *a, **k: printed.append("rank asked") or 0)
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append(a[0]))
    leanhooks.apply()
    try:
        assert all(m.print_rank_0 is not stock for m in holders) and nvtx.enable_nvtx is False
        pp.print_rank_0("quiet")
        pp.print_rank_0("asked for", force=True)
        assert printed == ["rank asked", "asked for"]  # stock asks the rank on every call
    finally:
        leanhooks.remove()
    assert all(m.print_rank_0 is stock for m in holders) and nvtx.enable_nvtx is True
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsight/libToolsInjection64.so")
    leanhooks.apply()
    try:
        assert nvtx.enable_nvtx is True  # a profiler listens: DeepSpeed's ranges stay
    finally:
        leanhooks.remove()


def test_lean_hooks_give_zero3_linear_its_signature_once(monkeypatch):
    """torch binds a `setup_context` Function's arguments to its forward's signature on every call;
    stock DeepSpeed's memory-efficient linear has `inspect` rebuild it each time, the lean hooks do not.
    The signature is inspect's own, and `remove` takes it away again."""
    import inspect

    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap

    from z3guard.adapter import leanhooks

    built = []
    rebuild = inspect._signature_from_function
    monkeypatch.setattr(inspect, "_signature_from_function", lambda *a, **k: built.append(1) or rebuild(*a, **k))
    x, w, b = torch.randn(3, 4), torch.randn(5, 4, requires_grad=True), torch.randn(5)
    expected = zero3_linear_wrap(x, w, b)
    assert built  # stock: rebuilt on the call
    forward = LinearFunctionForZeroStage3.forward
    signature = inspect.signature(forward)
    leanhooks.apply()
    try:
        assert forward.__signature__ == signature
        built.clear()
        assert torch.equal(zero3_linear_wrap(x, w, b), expected) and built == []
    finally:
        leanhooks.remove()
    assert "__signature__" not in vars(forward)


def test_lean_hooks_list_a_modules_parameters_as_zero3_does():
    """ZeRO-3's coordinator lists a module's parameters at every fetch and release (`iter_params`). The
    lean list holds the same parameters in the same order as stock's, for every module of a Hugging Face
    GPT-2, recursively or not, with shared submodules, a parameter registered twice, an unset one, an
    external one and an ordered container reordered; below a module class or instance with its own
    listing methods stock's function runs."""
    import collections
    import itertools

    import transformers
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero.partition_parameters import _init_external_params
    from torch import nn

    from z3guard.adapter import leanhooks

    class Renamed(nn.Linear):  # lists only its weight
        def named_parameters(self, *args, **kwargs):
            return iter([("weight", self.weight)])

    shared = nn.Linear(2, 2)
    moved = nn.Linear(2, 2)  # an ordered container (ZeRO-3's is one) whose order is not the dict's
    moved._parameters = collections.OrderedDict(moved._parameters)
    moved._parameters.move_to_end("weight")
    block = nn.Sequential(nn.Linear(2, 3), nn.Sequential(shared, nn.ReLU(), shared), nn.LayerNorm(3), moved,
                          Renamed(3, 3))
    block.register_parameter("unset", None)
    block.register_parameter("again", shared.weight)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    modules = [*block.modules(), *gpt2.modules()]
    for m in modules:
        _init_external_params(m)  # as ZeRO-3 does for every module
    outside = nn.Parameter(torch.ones(1))
    block._external_params[id(outside)] = outside  # what register_external_parameter(block, ...) adds

    def stock(m, recurse):
        return [p for _, p in itertools.chain(m.named_parameters(recurse=recurse), m.ds_external_parameters())]

    assert len(stock(block, False)) == 2 and len(stock(block, True)) == 11  # shared once; all of Renamed's
    assert [p.dim() for p in stock(moved, False)] == [1, 2]  # bias, then weight
    leanhooks.apply()
    try:
        lean = ppc.iter_params
        assert lean is not leanhooks._undo and lean.__module__ == leanhooks.__name__
        for m, recurse in itertools.product(modules, (False, True)):
            got, want = list(lean(m, recurse)), stock(m, recurse)
            assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), (type(m).__name__, recurse)
        assert leanhooks.module_parameters(block, recurse=True) is None  # Renamed below it: stock's function
        assert leanhooks.module_parameters(block[0], recurse=True) is not None
        block[0].named_parameters = block[0].named_parameters  # set on the instance: its own listing
        assert leanhooks.module_parameters(block[0]) is None
    finally:
        leanhooks.remove()
    assert ppc.iter_params.__module__ == ppc.__name__


def test_grad_bucket_slices_the_bucket_as_stock_does():
    """The bucket slice a gradient is copied into: stock's `narrow(...).view_as(grad)`, or `as_strided`
    with the strides that gave, once a shape has come by: the same storage, offset, shape and strides."""
    from types import SimpleNamespace

    from z3guard.adapter.gradbucket import _copy_into

    buffer = torch.zeros(1000)
    bucket = SimpleNamespace(buffer=buffer, elements=0)
    grads = [torch.randn(s) for s in [(3, 4), (7,), (), (1, 5), (2, 1, 3), (3, 4), (7,), (), (1, 5), (2, 1, 3)]]
    grads.append(torch.randn(4, 3).t())  # not contiguous: the slice is still contiguous, as view_as makes it
    for grad in grads:
        want = buffer.narrow(0, bucket.elements, grad.numel()).view_as(grad)
        got = _copy_into(bucket, grad)
        assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
        assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() and torch.equal(got, grad)
        bucket.elements += grad.numel()


def test_grad_bucket_covers_the_plain_paths_and_leaves_nsys_its_range(monkeypatch):
    """The lean bucket copy goes on for the CPU accelerator's stock path (every offload setting, checked
    against stock in this suite) and for CUDA's without offload (checked on GPUs: bench/steady_state.py);
    never beside ZenFlow, and not while a profiler's NVTX tool is injected, so that nsys keeps DeepSpeed's
    range around the copy."""
    from types import SimpleNamespace

    from z3guard.adapter import gradbucket

    stage3 = SimpleNamespace(ipg_buckets={}, zenflow=False)  # what it reads of the optimizer
    assert gradbucket.why_off(stage3) is None  # the CPU accelerator these tests run on
    assert "ZenFlow" in gradbucket.why_off(SimpleNamespace(ipg_buckets={}, zenflow=True))
    assert gradbucket.why_off(SimpleNamespace(zenflow=False)) is not None  # a stage 3 without buckets
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsight/libToolsInjection64.so")
    assert "NVTX" in gradbucket.why_off(stage3)


def test_fast_paths_are_bit_identical_over_30_steps_with_skips(runs):
    """Real ZeRO-3, offload of parameters and optimizer, fp16: stock vs z3guard with its fast paths; and
    without offload, two micro-steps per step."""
    skips = [3, 10, 25, 26]  # one right after another too
    common = dict(steps=30, skip_at=skips)
    off = {"fast_writeback": False, "fast_overflow_check": False, "fast_persistent_gather": False,
           "fast_fused_step": False, "fast_grad_offload": False, "fast_hook_calls": False, "fast_grad_norm": False}
    on_device = dict(steps=8, skip_at=[3], grad_accum=2, config={"zero_optimization": {
        "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}}})
    done = launch([Job("stock", **common), Job("fast", guard=True, **common),
                   Job("plain", guard=True, options=off, **common), Job("stock-on-device", **on_device),
                   Job("fast-on-device", guard=True, **on_device)], runs / "fastpaths")
    stock, fast, plain = (done.result(n) for n in ("stock", "fast", "plain"))
    assert done.result("fast-on-device")["foreach_copies"] > 0 and fast["foreach_copies"] == 0  # grad_bucket's
    assert "grad_norm" in done.result("fast-on-device")["fast_paths"] and "grad_norm" not in fast["fast_paths"]
    assert {"overflow_check", "persistent_gather", "grad_offload", "lean_hooks",
            "grad_bucket"} <= set(fast["fast_paths"])
    assert plain["fast_paths"] == []
    assert fast["presigned_hooks"] > 0 and plain["presigned_hooks"] == 0  # lean_hooks' Function signatures
    # every gradient's norm and fp32 cast taken from the partition still on the device; the global norm
    # summed on the host at every step that was not skipped
    moved = fast["grad_offload"]
    assert moved["from_device"] > 0 and moved["copied_back"] == 0
    assert moved["norms_summed_on_host"] == (30 - len(skips)) * fast["optimizer_sub_groups"]
    assert stock["skipped"] == fast["skipped"] == skips
    # every gradient arrived on every step: the norms decided each check, no buffer was read
    assert fast["overflow_reads"] == {"checks": 30, "elements_read": 0}
    assert fast["persistent_kept"] > 0 and plain["persistent_kept"] is None  # kept gathered through the step
    # ... and released after each skipped step, where stock leaves them: the next forward gathers them
    # again (z3guard's restore counts them) exactly as often as with the fast paths off
    assert fast["restored"] == plain["restored"] > 0
    for name in ("fast", "plain"):  # losses, weights, both ranks' optimizer states
        diff = compare.first_job_difference(done, "stock", name)
        assert diff is None, f"{name}: {diff}"
    diff = compare.first_job_difference(done, "stock-on-device", "fast-on-device")  # without offload
    assert diff is None, str(diff)


def _stage3_like(norms: dict, noted: dict, sizes=(4, 6)):
    """What `nonfinite_gradients` reads of stage 3: the flat host buffer, its per-parameter regions, the
    norms stage 3 took and the ones the fast path saw it take."""
    from types import SimpleNamespace

    buffer, params = torch.zeros(sum(sizes), dtype=torch.float16), [SimpleNamespace(ds_id=i) for i in range(len(sizes))]
    regions, start = {}, 0
    for p, n in zip(params, sizes):
        regions[p.ds_id], start = buffer[start:start + n], start + n
    opt = SimpleNamespace(fp16_groups=[params], get_param_id=lambda p: p.ds_id, norm_for_param_grads=norms,
                          z3guard_normed=noted, z3guard_overflow_reads={"checks": 0, "elements_read": 0})
    setattr(opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", regions)
    return opt, buffer


def test_overflow_check_reads_the_regions_no_current_norm_covers():
    one, two = torch.tensor(1.0), torch.tensor(2.0)
    opt, buffer = _stage3_like({0: one, 1: two}, {0: (one, 4), 1: (two, 6)})
    assert nonfinite_gradients(opt, buffer, None) is False and opt.z3guard_overflow_reads["elements_read"] == 0
    opt, buffer = _stage3_like({0: one, 1: torch.tensor(float("inf"))}, {0: (one, 4), 1: (two, 6)})
    assert nonfinite_gradients(opt, buffer, None) is False  # norm 1 replaced since (not the one noted): read
    assert opt.z3guard_overflow_reads["elements_read"] == 6
    for norms, noted in [({0: one, 1: two}, {0: (one, 4), 1: (two, 6)}),  # both covered, but region 1 ...
                         ({0: one}, {0: (one, 4)}),  # ... no gradient this step, left from an earlier one
                         ({0: one, 1: two}, {0: (one, 4), 1: (two, 5)})]:  # the norm covered part of it
        opt, buffer = _stage3_like(norms, noted)
        buffer[7] = float("nan")
        covered = len(noted) == 2 and noted[1][1] == 6
        assert nonfinite_gradients(opt, buffer, None) is (not covered)  # read only where not covered
    opt, buffer = _stage3_like({0: one, 1: torch.tensor(float("nan"))}, {0: (one, 4)})
    opt.z3guard_normed[1] = (opt.norm_for_param_grads[1], 6)
    assert nonfinite_gradients(opt, buffer, None) is True  # a non-finite norm: an overflow, nothing read
    assert opt.z3guard_overflow_reads["elements_read"] == 0


def test_a_region_written_again_loses_its_norm_note():
    """A micro-step of accumulation writes a region without taking its norm: the note must not outlive it."""
    from types import SimpleNamespace

    from z3guard.adapter.overflow import _partition_grads

    written = []
    params = [SimpleNamespace(ds_id=i) for i in range(3)]
    opt = SimpleNamespace(z3guard_normed={0: ("n0", 4), 1: ("n1", 4), 2: ("n2", 4)},
                          z3guard_stock_partition_grads=lambda ps, gs: written.extend(p.ds_id for p in ps))
    _partition_grads(opt, params[:2], [None, None])
    assert written == [0, 1] and opt.z3guard_normed == {2: ("n2", 4)}


TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("environ, launcher, left", [
    (TORCHRUN, {}, True),  # torchrun's default: its own environment had no OMP_NUM_THREADS
    (TORCHRUN, {"OMP_NUM_THREADS": "1"}, False),  # the user's 1, passed through torchrun
    ({**TORCHRUN, "OMP_NUM_THREADS": "4"}, {}, False),  # a count someone chose
    ({"OMP_NUM_THREADS": "1"}, {}, False),  # not torchrun (srun, mpirun: their environ is no evidence)
    (TORCHRUN, None, False),  # the launcher's environment unreadable: leave it alone
])
def test_host_threads_only_replace_torchruns_default(environ, launcher, left):
    assert launcher_left_one_thread(environ, launcher) is left


def test_host_threads_and_fused_step_are_bit_identical_with_ds_cpu_adam_over_30_steps_with_skips(runs):
    """DeepSpeedCPUAdam on the offloaded optimizer: stock on one thread per rank, z3guard on two with
    unscale, Adam and write-back fused, over several sub-groups (one chunk each on this model:
    test_fused_update_* splits a partition into many)."""
    ds_adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "zero_optimization": {"sub_group_size": 5000}}
    skips = [3, 10, 25, 26]  # one right after another too
    common = dict(steps=30, skip_at=skips, config=ds_adam)
    done = launch([Job("stock", **common), Job("threads", guard=True, options={"host_threads": 2}, **common)],
                  runs / "host-threads")
    stock, threads = done.result("stock"), done.result("threads")
    assert {"host_threads=2", "fused_step", "grads_cast_on_host"} <= set(threads["fast_paths"])
    assert threads["optimizer_sub_groups"] >= 3
    assert stock["skipped"] == threads["skipped"] == skips
    diff = compare.first_job_difference(done, "stock", "threads")  # losses, weights, both ranks' optimizers
    assert diff is None, str(diff)


NOTED = [(0, 30_000), (30_000, 70_001), (80_000, 80_500)]  # the rest in memory: chunks partly covered


@pytest.mark.parametrize("chunk, noted", [(128, []), (4096, []), (1 << 20, []), (4096, NOTED), (1 << 20, NOTED)])
def test_fused_update_is_bit_identical_to_ds_cpu_adam_in_three_passes(chunk, noted, monkeypatch):
    """The fused step's chunks against DeepSpeed's three whole-partition passes (unscale, DeepSpeedCPUAdam,
    cast), over several steps of an odd-sized partition (its tail runs the kernel's narrower code). With
    `noted`, the gradient there is only noted (hostgrads: its fp16 region, cast) and the fused step reads the
    region; the memory under the notes holds NaNs, so any read of it shows."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from z3guard.adapter.fusedstep import fused_update
    from z3guard.adapter.hostgrads import Lazy, Run
    from z3guard.scenarios.launch import rank_env

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", rank_env("cpu")["TORCH_EXTENSIONS_DIR"])  # the ranks' build
    n, gen = 100_003, torch.Generator().manual_seed(3)
    start = torch.randn(n, generator=gen)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    lows = [torch.empty(n, dtype=torch.float16) for _ in range(2)]
    stock, fused = (DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01) for p in params)
    for step in range(1, 5):
        grad = torch.randn(n, generator=gen) * 1024
        region = grad.half()
        if noted:  # what the backward copied to the host: fp16
            grad = region.float()
        factor = 1. / torch.tensor(1024.0 * (1 + step / 7))
        params[0].grad, params[1].grad = grad.clone(), grad.clone()
        for a, b in noted:
            params[1].grad[a:b] = float("nan")
        params[0].grad.mul_(factor)
        stock.step()
        lows[0].copy_(params[0].data)
        state = fused.state[params[1]]
        if not state:
            state.update(step=0, exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))
        state["step"] += 1
        fused_update(fused, fused.param_groups[0], state, params[1].data, params[1].grad, lows[1], factor, chunk,
                     runs=[Run(a, b, region[a:b]) for a, b in noted])
        after = params[1].grad.clone()
        for a, b in noted:  # what a reader gets after the step: the region, cast, unscaled
            Lazy(a, region[a:b], scaled_by=factor).write(after)
        assert torch.equal(after.view(torch.int32), params[0].grad.view(torch.int32))
    for a, b in [(params[0].data, params[1].data), (lows[0], lows[1]),
                 (stock.state[params[0]]["exp_avg"], fused.state[params[1]]["exp_avg"]),
                 (stock.state[params[0]]["exp_avg_sq"], fused.state[params[1]]["exp_avg_sq"])]:
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.int16),
                           b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.int16))


def test_fused_step_steps_aside_for_what_expects_ds_cpu_adam_step_to_run(monkeypatch):
    """Step hooks and LR schedulers built on the optimizer see its `step` run: the fused step keeps out."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from z3guard.adapter.fusedstep import _steps_plainly
    from z3guard.scenarios.launch import rank_env

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", rank_env("cpu")["TORCH_EXTENSIONS_DIR"])
    new = (lambda: DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))], lr=1e-3))
    assert _steps_plainly(new())
    hooked = new()
    handle = hooked.register_step_post_hook(lambda *a: None)
    assert not _steps_plainly(hooked)
    handle.remove()
    assert _steps_plainly(hooked)
    scheduled = new()  # a torch LR scheduler only counts steps (Hugging Face Trainer builds one on it)
    torch.optim.lr_scheduler.StepLR(scheduled, step_size=1)
    assert "step" in vars(scheduled) and _steps_plainly(scheduled)
    counted = scheduled.step

    def foreign(*args, **kwargs):  # anything else wrapped around step: keep out
        return counted(*args, **kwargs)

    scheduled.step = functools.wraps(counted)(foreign)
    assert not _steps_plainly(scheduled)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda *a: None)
    try:
        assert not _steps_plainly(new())
    finally:
        handle.remove()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_norms_summed_on_the_host_match_stocks_device_loop(dtype):
    """The global norm's sum of squares, against stock's loop of tensor ops, on norms whose sum depends
    on the order and precision of its additions (a pairwise or fp64 sum of fp32 norms would differ)."""
    from z3guard.adapter.gradoffload import sum_of_squares

    def stock(norms):  # DeepSpeed 0.19's complete_grad_norm_calculation_for_cpu_offload
        total = 0.0
        for n in norms:
            total += n ** 2
        return float(total)

    g = torch.Generator().manual_seed(5)
    scales = 10.0 ** torch.randint(-4, 5, (392,), generator=g)
    norms = [n.to(dtype) for n in torch.rand(392, generator=g, dtype=torch.float64) * scales] + \
        [torch.tensor(v, dtype=dtype) for v in (0.0, 1e-30, 3.0, 1.0 + 2**-20)]
    assert sum_of_squares(norms) == stock(norms)
    assert stock(norms[::-1]) != stock(norms)  # the order shows in the bits: the check above can fail
    for special in ("inf", "nan"):
        with_special = norms + [torch.tensor(float(special), dtype=dtype)]
        assert repr(sum_of_squares(with_special)) == repr(stock(with_special))


def test_no_fast_path_where_something_else_replaced_a_method_on_the_optimizer():
    """ZenFlow's overlapped step sets its own `step` and `partition_grads` on the stage-3 instance: the fast
    paths follow stock's code, so none is applied there (and removing them leaves its methods in place)."""
    from types import SimpleNamespace

    from z3guard.adapter import fastpaths

    def own_partition_grads(params, grads):
        return []

    opt = SimpleNamespace(partition_grads=own_partition_grads, fp16_partitioned_groups_flat=[],
                          grad_partitions_flat_buffer=None, offload_optimizer=True)
    engine = SimpleNamespace(optimizer=opt)
    assert fastpaths.apply(engine, writeback=True, overflow_check=True, persistent_gather=True,
                           fused_step=True, grad_offload=True) == []
    fastpaths.remove(engine)
    assert vars(opt)["partition_grads"] is own_partition_grads


def _cgroup(tmp_path, membership: str, files: dict[str, str]):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "self-cgroup").write_text(membership)
    return tmp_path, tmp_path / "self-cgroup"


@pytest.mark.parametrize("membership, files, quota", [
    ("0::/pod/ctr\n", {"pod/ctr/cpu.max": "max 100000\n", "pod/cpu.max": "300000 100000\n"}, 3),  # a parent's
    ("0::/\n", {"cpu.max": "250000 100000\n"}, 2),  # inside the container its cgroup is the root; rounded down
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # no quota
    ("0::/\n", {"cpu.max": "20000 100000\n"}, 1),  # a fifth of a CPU: one thread, not none
    ("5:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}, 4),
    ("5:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
])
def test_host_threads_honour_the_containers_cpu_quota(tmp_path, monkeypatch, membership, files, quota):
    """A pod limited to a few CPUs on a big host sees every core in its affinity mask."""
    import os

    from z3guard.adapter.hostthreads import usable_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))  # the host's 64 cores
    root, self_cgroup = _cgroup(tmp_path, membership, files)
    assert usable_cpus(root, self_cgroup) == (64 if quota is None else quota)
    assert usable_cpus(root, tmp_path / "missing") == 64  # no cgroup information: the affinity mask


def test_quiet_modules_takes_all_four_hooks_off_parameterless_subtrees_only():
    """ZeRO-3's four hooks per module (two before the forward, two after it, as DeepSpeedZeRoOffload keeps
    their handles) come off the modules with no parameter below them, all four or none; a module given an
    external parameter, or with hooks other than the four, keeps its own."""
    from types import SimpleNamespace

    from torch import nn

    from z3guard.adapter import quietmodules

    model = nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Sequential(nn.Dropout(0.0), nn.ReLU()), nn.Identity(),
                          nn.Tanh())
    model[3]._external_params = {1: nn.Parameter(torch.zeros(1))}  # as register_external_parameter leaves it
    offload = SimpleNamespace(forward_hooks=[], backward_hooks=[])
    for m in model.modules():
        offload.forward_hooks.append(m.register_forward_pre_hook(lambda *a: None))
        offload.forward_hooks.append(m.register_forward_hook(lambda *a: None))
        offload.backward_hooks.append(m.register_forward_hook(lambda *a: None))
        if m is not model[4]:  # Tanh: one hook short of the four
            offload.backward_hooks.append(m.register_forward_pre_hook(lambda *a: None))
    assert quietmodules.quiet(offload, model) == 4  # GELU, the inner Sequential, Dropout, ReLU
    hooks = {m: len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()}
    assert [hooks[m] for m in (model, model[0], model[3], model[4])] == [4, 4, 4, 3]
    assert all(hooks[m] == 0 for m in (model[1], model[2], model[2][0], model[2][1]))
    assert quietmodules.quieted(model) == 4
    for handle in offload.forward_hooks + offload.backward_hooks:  # as DeepSpeed removes its hooks later
        handle.remove()
