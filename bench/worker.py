"""One benchmark group on every rank: `torchrun ... bench/worker.py SPEC.json` (see bench/run.py)."""
from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import date
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import models  # noqa: E402

VARIANT_CONFIG = {  # stock DeepSpeed, and its workarounds as config
    "stock": {},
    "stock-tuned": {},  # with this rank's share of the cores as its threads (TUNED)
    "stock-bf16": {},
    "stock-persist0": {"stage3_param_persistence_threshold": 0},
    "stock-noprefetch": {"stage3_prefetch_bucket_size": 0},
}
GUARD_OPTIONS = {  # z3guard, with all its fast paths, none (the trace logic alone), or all but one
    "z3guard": {},
    "z3guard-bf16": {},
    "z3guard-nofast": {"fast_writeback": False, "fast_overflow_check": False, "fast_persistent_gather": False,
                       "fast_fused_step": False, "fast_grad_offload": False, "fast_block_fetch": False,
                       "fast_hook_calls": False, "fast_grad_norm": False, "host_threads": 0},
    "z3guard-nolean": {"fast_hook_calls": False},
    "z3guard-nofused": {"fast_fused_step": False},
    "z3guard-nothreads": {"host_threads": 0},
    "z3guard-threads8": {"host_threads": 8},
    "z3guard-nogather": {"fast_persistent_gather": False},
    "z3guard-nowriteback": {"fast_writeback": False},
    "z3guard-nocheck": {"fast_overflow_check": False},
    "z3guard-nogradoffload": {"fast_grad_offload": False},
    "z3guard-noblocks": {"fast_block_fetch": False},
}
FSDP2 = {"fsdp2", "fsdp2-tuned"}  # PyTorch's FSDP2, not DeepSpeed (fsdp2.py); bf16
TUNED = {"stock-tuned", "fsdp2-tuned"}  # threads as a careful user sets them, not torchrun's 1 per rank
BF16 = {"stock-bf16", "z3guard-bf16", *FSDP2}  # bf16 on GPUs too: the same precision as FSDP2's runs
VARIANTS = [*VARIANT_CONFIG, *GUARD_OPTIONS, *FSDP2]
OFFLOAD = {
    "none": {},
    "param": {"offload_param": {"device": "cpu", "pin_memory": True}},
    "param+optimizer": {"offload_param": {"device": "cpu", "pin_memory": True},
                        "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


def precision(variant: str, device: str) -> str:
    """fp16 on GPUs, as the published tables ran; bf16 for the -bf16 variants and FSDP2 (to compare at
    equal precision), and on the CPU smoke run (DeepSpeed's CPU accelerator refuses fp16)."""
    return "fp16" if device == "cuda" and variant not in BF16 else "bf16"


def config(variant: str, offload: str, micro_batch: int, world: int, device: str) -> dict:
    """ZeRO-3 defaults (overlap_comm, persistence 1e5, prefetch bucket 5e7); fp16 from scale 2^10 or bf16
    as `precision` says."""
    zero = {"stage": 3, **OFFLOAD[offload], **VARIANT_CONFIG.get(variant, {})}  # z3guard's: stock config
    mixed = {"fp16": {"enabled": True, "initial_scale_power": 10}} if precision(variant, device) == "fp16" \
        else {"bf16": {"enabled": True}}
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "train_batch_size": micro_batch * world,
           "gradient_clipping": 1.0, **mixed,
           "zero_optimization": zero, "steps_per_print": 10**9, "zero_force_ds_cpu_optimizer": False}
    if offload == "param+optimizer" and device == "cuda":  # DeepSpeedCPUAdam (its JIT build is minutes on CPU)
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    return cfg


def make_engine(name: str, cfg: dict, device: str):
    """The benchmark model under ZeRO-3 (built already partitioned on GPUs) and its engine, seeded alike
    for every run; the client AdamW (fused) on the GPU unless `cfg` names an optimizer. Returns (engine, size, sync)."""
    import deepspeed

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=device == "cuda"):
        model, size = models.make(name, device)
    # fused on GPUs, as FSDP2's runs (fsdp2.py) and as a careful user sets it (Trainer's adamw_torch_fused)
    kwargs = {} if "optimizer" in cfg else {
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, **kwargs)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return engine, size, sync


def timed_step(engine, args: tuple, kw: dict, target: torch.Tensor, sync) -> tuple[float, float, float]:
    """One forward (with the loss), backward and optimizer step; the seconds of each, each phase timed to
    the device's completion (what the next phase starts with waits for the last one's kernels anyway)."""
    sync()
    t0 = time.perf_counter()
    out = engine(*args, **kw)
    loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
    sync()
    t1 = time.perf_counter()
    engine.backward(loss)
    sync()
    t2 = time.perf_counter()
    engine.step()
    sync()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


StepFn = Callable[[tuple, dict, torch.Tensor], tuple[float, float, float, bool]]  # phases' seconds, applied


@contextmanager
def rank_threads(tuned: bool) -> Iterator[None]:
    """For the -tuned variants: this rank's share of the usable cores (cgroup quota honoured, at least 1)
    as its threads, as a user who sets OMP_NUM_THREADS runs, where torchrun leaves each rank 1.
    DeepSpeedCPUAdam is a bare `omp parallel for`, so omp_get_max_threads of the OpenMP runtime it runs in
    decides: torch's (torch.set_num_threads), or a libgomp of the op's own, which reads OMP_NUM_THREADS as
    it loads (set here, before the engine builds the op) or takes threadpoolctl's limit once loaded. The
    counts come back after the run, so the group's next run starts as torchrun left it."""
    if not tuned:
        yield
        return
    from threadpoolctl import ThreadpoolController

    from z3guard.adapter.hostthreads import usable_cpus

    n = max(1, usable_cpus() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torch_before, env_before = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    ThreadpoolController().limit(limits=n, user_api="openmp")
    try:
        yield
    finally:
        torch.set_num_threads(torch_before)
        ThreadpoolController().limit(limits=torch_before, user_api="openmp")  # any loaded during the run too
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before


def measure(spec: dict, size: models.Size, rank: int, world: int, device: torch.device, dtype: torch.dtype,
            step: StepFn, before: tuple[int, int]) -> dict:
    """Warm-up, then the timed steps on the same seeded batches for every variant; the record's fields
    that every variant shares. `before`: device memory and host RSS before the model was built (`marks`)."""
    times, phases, skipped, tokens = [], {"forward": [], "backward": [], "step": []}, 0, 0
    warmup_times = []
    for i in range(1, spec["warmup"] + spec["steps"] + 1):
        args, kw, target, tokens = models.batch(spec["model"], size, i, rank, device, dtype)
        if i == spec["warmup"] + 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        *took, applied = step(args, kw, target)
        if i <= spec["warmup"]:
            warmup_times.append(sum(took))
        else:
            times.append(sum(took))
            for key, seconds in zip(phases, took):
                phases[key].append(seconds)
            skipped += not applied
    baseline, rss_before = before
    flops = models.flops_per_token(spec["model"], device.type)
    return {
        "model": spec["model"], "variant": spec["variant"], "offload": spec["offload"], "device": device.type,
        "gpus": world if device.type == "cuda" else 0, "deepspeed": version("deepspeed"), "torch": torch.__version__,
        "date": date.today().isoformat(), "steps": len(times), "warmup": spec["warmup"],
        "precision": "bf16" if dtype == torch.bfloat16 else "fp16",
        "threads": torch.get_num_threads(), "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "median_step_s": statistics.median(times), "min_step_s": min(times), "steps_s": times,
        "tokens_per_s": tokens * world / statistics.median(times),
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "model_flops_per_token": flops, "mfu": _mfu(flops, tokens / statistics.median(times), device),
        "peak_gpu_mem_bytes": torch.cuda.max_memory_allocated() - baseline if device.type == "cuda" else None,
        "phase_median_s": {k: statistics.median(v) for k, v in phases.items()},
        "phases_s": phases, "warmup_steps_s": warmup_times,  # every timed step's phases; the untimed steps
        "host_rss_bytes": _process().memory_info().rss, "host_rss_before_bytes": rss_before,
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # of the process
        "skipped_steps": skipped, "fetch_wait_s": None,
    }


def _mfu(flops_per_token: float | None, tokens_per_s_per_gpu: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation of one GPU: its tokens/s times the model's FLOPs per token over its peak."""
    peak = models.peak_flops(device)
    return None if flops_per_token is None or peak is None else tokens_per_s_per_gpu * flops_per_token / peak


def _process():
    import psutil

    return psutil.Process()


def marks(device: torch.device) -> tuple[int, int]:
    """Earlier runs' leftovers on the device, and the host RSS (which only grows through a process: the
    record compares the growth)."""
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0, _process().memory_info().rss


def run_deepspeed(spec: dict, rank: int, world: int, device: torch.device) -> dict:
    """One DeepSpeed ZeRO-3 run, stock or under z3guard."""
    import z3guard
    from z3guard import adapter

    name, variant, offload = spec["model"], spec["variant"], spec["offload"]
    z3guard.uninstall()
    if variant in GUARD_OPTIONS:
        z3guard.install(z3guard.GuardOptions(warn=False, **GUARD_OPTIONS[variant]))
    size = models.Size.of(device.type, name)
    micro = size.batch * (4 if name == "clip" else 1)
    cfg = config(variant, offload, micro, world, device.type)
    before = marks(device)
    engine, size, sync = make_engine(name, cfg, device.type)
    count_invalidations = adapter.load().count_invalidations(engine)

    def step(args: tuple, kw: dict, target: torch.Tensor) -> tuple[float, float, float, bool]:
        return *timed_step(engine, args, kw, target, sync), engine.was_step_applied()

    dtype = torch.float16 if precision(variant, device.type) == "fp16" else torch.bfloat16
    record = measure(spec, size, rank, world, device, dtype, step, before)
    g = z3guard.guard(engine) if variant in GUARD_OPTIONS else None
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    record |= {
        "optimizer": type(inner).__name__ + (" (fused)" if getattr(inner, "defaults", {}).get("fused") else ""),
        "invalidations": count_invalidations(),
        "trace_switches": g.trace.cache.switches if g else None,
        "trace_recordings": g.trace.cache.recordings if g else None,
        "trace_resyncs": g.trace.cache.resyncs if g else None,
        "fast_paths": g.fast_paths if g else [],
    }
    engine.destroy()
    z3guard.uninstall()
    return record


def run_fsdp2(spec: dict, rank: int, world: int, device: torch.device) -> dict:
    """PyTorch FSDP2 on the same model, seed, batches and timing, in bf16 (fsdp2.py)."""
    import fsdp2

    before = marks(device)
    run = fsdp2.Run(spec["model"], spec["offload"], device)
    record = measure(spec, run.size, rank, world, device, torch.bfloat16, run.step, before) | run.notes()
    run.close()
    return record


def run_one(spec: dict, rank: int, world: int, device: torch.device) -> dict:
    """One run of the group: its variant's setup, its steps, its record; what it held is freed after."""
    if spec["variant"] not in VARIANTS:
        raise ValueError(f"unknown variant {spec['variant']!r}: one of {VARIANTS}")
    with rank_threads(spec["variant"] in TUNED):
        run = run_fsdp2 if spec["variant"] in FSDP2 else run_deepspeed
        record = run(spec, rank, world, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def main(spec_path: str) -> None:
    import deepspeed
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    if spec["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(spec["out"])
    for i, run in enumerate(spec["runs"]):
        record = run_one({**run, "warmup": spec["warmup"], "steps": spec["steps"]}, rank, world, device)
        if rank == 0:
            (out / f"record-{i:03d}.json").write_text(json.dumps(record))
            print(f"bench: {record['model']:<10} {record['variant']:<17} {record['offload']:<16} "
                  f"median {record['median_step_s'] * 1e3:9.1f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)
