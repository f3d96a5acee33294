"""One benchmark group on every rank: `torchrun ... bench/worker.py SPEC.json` (see bench/run.py)."""
from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import sys
import time
from datetime import date
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import models  # noqa: E402

VARIANT_CONFIG = {  # stock DeepSpeed, and its workarounds as config
    "stock": {},
    "stock-persist0": {"stage3_param_persistence_threshold": 0},
    "stock-noprefetch": {"stage3_prefetch_bucket_size": 0},
}
GUARD_OPTIONS = {  # z3guard, with all its fast paths, none (the trace logic alone), or all but one
    "z3guard": {},
    "z3guard-nofast": {"fast_writeback": False, "fast_overflow_check": False, "fast_persistent_gather": False,
                       "fast_fused_step": False, "fast_grad_offload": False, "fast_block_fetch": False,
                       "host_threads": 0},
    "z3guard-nofused": {"fast_fused_step": False},
    "z3guard-nothreads": {"host_threads": 0},
    "z3guard-threads8": {"host_threads": 8},
    "z3guard-nogather": {"fast_persistent_gather": False},
    "z3guard-nowriteback": {"fast_writeback": False},
    "z3guard-nocheck": {"fast_overflow_check": False},
    "z3guard-nogradoffload": {"fast_grad_offload": False},
    "z3guard-noblocks": {"fast_block_fetch": False},
}
OFFLOAD = {
    "none": {},
    "param": {"offload_param": {"device": "cpu", "pin_memory": True}},
    "param+optimizer": {"offload_param": {"device": "cpu", "pin_memory": True},
                        "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}


def config(variant: str, offload: str, micro_batch: int, world: int, device: str) -> dict:
    """ZeRO-3 defaults (overlap_comm, persistence 1e5, prefetch bucket 5e7); fp16 from scale 2^10 on
    GPUs, bf16 on the CPU smoke run (DeepSpeed's CPU accelerator refuses fp16)."""
    zero = {"stage": 3, **OFFLOAD[offload], **VARIANT_CONFIG.get(variant, {})}  # z3guard's: stock config
    precision = {"fp16": {"enabled": True, "initial_scale_power": 10}} if device == "cuda" else \
        {"bf16": {"enabled": True}}
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "train_batch_size": micro_batch * world,
           "gradient_clipping": 1.0, **precision,
           "zero_optimization": zero, "steps_per_print": 10**9, "zero_force_ds_cpu_optimizer": False}
    if offload == "param+optimizer" and device == "cuda":  # DeepSpeedCPUAdam (its JIT build is minutes on CPU)
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    return cfg


def make_engine(name: str, cfg: dict, device: str):
    """The benchmark model under ZeRO-3 (built already partitioned on GPUs) and its engine, seeded alike
    for every run; the client AdamW on the GPU unless `cfg` names an optimizer. Returns (engine, size, sync)."""
    import deepspeed

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=device == "cuda"):
        model, size = models.make(name, device)
    kwargs = {} if "optimizer" in cfg else {"optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4)}
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


def run_one(spec: dict, rank: int, world: int, device: torch.device) -> dict:
    import psutil

    import z3guard
    from z3guard import adapter

    name, variant, offload = spec["model"], spec["variant"], spec["offload"]
    if variant not in VARIANT_CONFIG and variant not in GUARD_OPTIONS:
        raise ValueError(f"unknown variant {variant!r}: one of {sorted({**VARIANT_CONFIG, **GUARD_OPTIONS})}")
    z3guard.uninstall()
    if variant in GUARD_OPTIONS:
        z3guard.install(z3guard.GuardOptions(warn=False, **GUARD_OPTIONS[variant]))
    size = models.Size.of(device.type)
    micro = size.batch * (4 if name == "clip" else 1)
    cfg = config(variant, offload, micro, world, device.type)
    baseline = torch.cuda.memory_allocated() if device.type == "cuda" else 0  # earlier runs' leftovers
    rss_before = psutil.Process().memory_info().rss  # RSS only grows through a process: compare the growth
    engine, size, sync = make_engine(name, cfg, device.type)
    count_invalidations = adapter.load().count_invalidations(engine)
    times, phases, skipped, tokens = [], {"forward": [], "backward": [], "step": []}, 0, 0
    warmup_times = []
    for step in range(1, spec["warmup"] + spec["steps"] + 1):
        dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        args, kw, target, tokens = models.batch(name, size, step, rank, device, dtype)
        if step == spec["warmup"] + 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        took = timed_step(engine, args, kw, target, sync)
        if step <= spec["warmup"]:
            warmup_times.append(sum(took))
        else:
            times.append(sum(took))
            for key, seconds in zip(phases, took):
                phases[key].append(seconds)
            skipped += not engine.was_step_applied()
    g = z3guard.guard(engine) if variant in GUARD_OPTIONS else None
    record = {
        "model": name, "variant": variant, "offload": offload, "device": device.type,
        "gpus": world if device.type == "cuda" else 0, "deepspeed": version("deepspeed"), "torch": torch.__version__,
        "date": date.today().isoformat(), "steps": len(times), "warmup": spec["warmup"],
        "median_step_s": statistics.median(times), "min_step_s": min(times), "steps_s": times,
        "tokens_per_s": tokens * world / statistics.median(times),
        "peak_gpu_mem_bytes": torch.cuda.max_memory_allocated() - baseline if device.type == "cuda" else None,
        "phase_median_s": {k: statistics.median(v) for k, v in phases.items()},
        "phases_s": phases, "warmup_steps_s": warmup_times,  # every timed step's phases; the untimed steps
        "host_rss_bytes": psutil.Process().memory_info().rss, "host_rss_before_bytes": rss_before,
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # of the process
        "invalidations": count_invalidations(),
        "trace_switches": g.trace.cache.switches if g else None,
        "trace_recordings": g.trace.cache.recordings if g else None,
        "trace_resyncs": g.trace.cache.resyncs if g else None,
        "skipped_steps": skipped, "fetch_wait_s": None, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "fast_paths": g.fast_paths if g else [],
    }
    engine.destroy()
    z3guard.uninstall()
    del engine
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
