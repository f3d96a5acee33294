"""One training job on one rank: build an engine, train, save/resume, report what happened."""
from __future__ import annotations

import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..checkpoint.errors import CheckpointError
from . import catalog
from .failure import Crash
from .config import merge, resolve_auto

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Job:
    """What one job does; every rank of a launch runs the same list of jobs in order."""

    name: str
    scenario: str = "clip"
    dtype: str = "fp16"
    guard: bool = False
    steps: int = 10  # last global step (1-based) to run
    skip_at: list[int] = field(default_factory=list)  # steps whose loss is made non-finite
    spike_at: list[int] = field(default_factory=list)  # steps whose inputs are scaled x1e4: a natural overflow
    save_at: list[int] = field(default_factory=list)  # save a checkpoint after these steps
    save_dir: str | None = None  # "{rank}" in it is this rank's number (a folder per rank, as per node)
    save_tag: str | None = None  # default "step<N>"
    fsize_limit: int | None = None  # bytes: make writes fail as on a full disk (from the 2nd save on)
    fsize_rank: int | None = None  # only this rank's writes fail (default: every rank's)
    load_dir: str | None = None  # resume from here (the step comes from the checkpoint)
    events: dict[str, list[str]] = field(default_factory=dict)  # "step" -> [gathered|partition|eval]
    regather_after_skip: bool = False  # the workaround users are given: re-gather persistent params
    grad_accum: int = 1
    # "step" -> what to do with the gradients through DeepSpeed's accessors, in this order: "before" (read
    # every full fp32 gradient before `step`), "halve" (set each to half of itself), "after" (read after `step`)
    grads: dict[str, list[str]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # z3guard.GuardOptions fields, when guarded
    preregister: bool = False  # register the scenario's cross-module reads by hand (stock workaround)
    register: list[list[str]] = field(default_factory=list)  # explicit [reader, parameter] pairs, likewise
    hf_path: str | None = None  # a local Hugging Face config/model folder (causal LM), batches generated
    seed: int = 1234
    track_memory: int = 0  # record this rank's RSS (and GPU memory on GPUs) every N steps
    model: str | None = None  # "pkg.module:function" factories for a user's own model and batches
    batch: str | None = None
    hidden: int = 512
    loss: str | None = None  # "pkg.module:function" (output, target) -> loss, for a model with no loss of its own
    layers: int | None = None  # with hf_path: build the model from its config with this many layers
    ds_config: dict[str, Any] | None = None  # the user's DeepSpeed config (Trainer's "auto" allowed), else HF's
    construct: str = "plain"  # "zero-init": build the model under deepspeed.zero.Init, as Hugging Face does
    # the global batch as micro-batch slots rank * grad_accum + micro, so that runs on different numbers of
    # ranks (grad_accum = slots / ranks) train on the same data; losses then also as the global mean
    global_batches: bool = False
    moments: bool = False  # the gathered state holds every parameter's full Adam moments too
    keep_state: bool = True  # False: no gathered state at the end (a large model's would fill the disk)
    state_after_load: bool = False  # keep the gathered state right after load_checkpoint as well

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Job":
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_config(job: Job, scenario: catalog.Scenario, world: int) -> dict[str, Any]:
    """The user's config with "auto" resolved, or Hugging Face's example with the scenario's overrides; then
    the job's own."""
    if job.ds_config is not None:
        cfg = resolve_auto(scenario.hidden, job.dtype, scenario.micro_batch, world, job.grad_accum,
                           base=job.ds_config, total_steps=job.steps)
    else:
        cfg = merge(resolve_auto(scenario.hidden, job.dtype, scenario.micro_batch, world, job.grad_accum),
                    scenario.config)
    cfg.setdefault("scheduler", {"type": "WarmupLR",
                                 "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}})
    return merge(cfg, job.config)


def build_model(job: Job, scenario: catalog.Scenario, config: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """The model as the user's job builds it. Under "zero-init", a Hugging Face model is built by
    transformers itself while an `HfDeepSpeedConfig` lives (as Trainer does; it is returned, to be kept
    alive), any other inside `deepspeed.zero.Init` with the job's config: parameters and buffers are made
    in the training dtype and partitioned as they are created."""
    if job.construct == "plain":
        return scenario.make_model(), None
    if job.construct != "zero-init":
        raise ValueError(f"construct: expected 'plain' or 'zero-init', got {job.construct!r}")
    if scenario.name.startswith("hf:"):
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(config)
        return scenario.make_model(), keep
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=config):
        return scenario.make_model(), None


def gathered_state(engine, moments: bool = False) -> dict[str, torch.Tensor]:
    """Full fp32 master weights and model-dtype weights by parameter name (collective), and buffers.

    One parameter per gather: DeepSpeed 0.14's coalesced gather waits for the last of its gloo
    all-gathers only (`_allgather_params_coalesced`; fixed by 0.19), so on CPU a gather of several
    parameters could hand back one still being written. A single parameter's gather is blocking."""
    from deepspeed.utils import safe_get_full_fp32_param
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        out[f"master/{name}"] = safe_get_full_fp32_param(p).detach().cpu().clone()
        with deepspeed.zero.GatheredParameters([p]):
            out[f"weight/{name}"] = p.detach().cpu().clone()
    for name, b in engine.module.named_buffers():  # BatchNorm's running statistics, say (this rank's)
        out[f"buffer/{name}"] = b.detach().cpu().clone()
    if moments:
        from deepspeed.utils import safe_get_full_optimizer_state

        for name, p in engine.module.named_parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
        steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s}
        out["optimizer/step"] = torch.tensor(sorted(steps))  # one count for every sub-group
    return out


def run(job: Job, rank: int, world: int, on_step: Callable[[str, int], None] = lambda j, s: None) -> dict:
    """Train per `job`; returns losses, skipped steps, the crash if any, and the final state."""
    import deepspeed

    scenario = catalog.resolve(job.scenario, job.model, job.batch, job.hidden, job.hf_path, job.loss, job.layers)
    dtype = DTYPES[job.dtype]
    random.seed(job.seed)
    np.random.seed(job.seed)
    torch.manual_seed(job.seed)
    config = build_config(job, scenario, world)
    model, hf_config = build_model(job, scenario, config)
    for reader, param in (list(scenario.reads) if job.preregister else []) + [tuple(p) for p in job.register]:
        deepspeed.zero.register_external_parameter(model.get_submodule("" if reader == "<root>" else reader),
                                                   model.get_parameter(param))
    # An "optimizer" block in the config lets DeepSpeed build its own (DeepSpeedCPUAdam with offload).
    optimizer = None if "optimizer" in config else torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           model_parameters=model.parameters() if optimizer is None else None)
    # DeepSpeed's errors name modules by their ZeRO id: `ds_id` since 0.15, `id` before.
    paths = {getattr(m, "ds_id", getattr(m, "id", None)): name or "<root>" for name, m in engine.module.named_modules()}
    start = 0
    result: dict[str, Any] = {"job": job.name, "losses": {}, "skipped": [], "crash": None}
    if job.load_dir:
        began = time.perf_counter()
        try:
            _, client = engine.load_checkpoint(job.load_dir.format(rank=rank))
        except RuntimeError as exc:  # z3guard's refusal (before loading anything), or stock's torn file
            result.update(load_error=str(exc), start=0, state=gathered_state(engine))
            engine.destroy()
            return result
        result["load_seconds"] = time.perf_counter() - began
        start = int((client or {}).get("step", engine.global_steps))
        if job.state_after_load:
            result["loaded_state"] = gathered_state(engine, job.moments)
            scaler = getattr(engine.optimizer, "loss_scaler", None)
            result["loaded_scale"] = float(getattr(scaler, "cur_scale", 1.0))
        if job.guard:
            import z3guard

            resumed = z3guard.resumed_state(engine) or {}
            result["data_position"] = resumed.get("data_position")
            result["saved_rank"] = resumed.get("saved_rank")  # from another number of ranks: whose state
    result["start"] = start
    step = start
    read: dict[str, torch.Tensor] = {}  # what DeepSpeed's gradient accessors returned, by step and name
    try:
        for step in range(start + 1, job.steps + 1):
            total = 0.0
            for micro in range(job.grad_accum):
                who, which = (rank * job.grad_accum + micro, 0) if job.global_batches else (rank, micro)
                args, kwargs, target = scenario.make_batch(step, which, who, dtype)
                args = tuple(a.to(engine.device) if torch.is_tensor(a) else a for a in args)
                target = target.to(engine.device)
                if step in job.spike_at:  # an outlier batch: fp16 activations overflow on their own
                    args = tuple(a * 1e4 if a.is_floating_point() else a for a in args)
                loss = scenario.loss(engine(*args, **kwargs), target)
                value = loss.item()
                if job.global_batches:
                    total += value
                if step in job.skip_at and micro == job.grad_accum - 1:
                    loss = loss * math.inf
                engine.backward(loss)
                actions = job.grads.get(str(step), []) if micro == job.grad_accum - 1 else []
                if "before" in actions:
                    read.update(_full_grads(engine, f"grad/{step}/before"))
                if "halve" in actions:
                    _halve_grads(engine)
                engine.step()
                if "after" in actions:
                    read.update(_full_grads(engine, f"grad/{step}/after"))
            result["losses"][str(step)] = value
            if job.global_batches:  # the mean over every rank's micro-batches (collective)
                mean = torch.tensor([total])
                torch.distributed.all_reduce(mean)
                result.setdefault("global_losses", {})[str(step)] = mean.item() / (world * job.grad_accum)
            _consume_rng()  # as dropout and augmentation would: resume must continue these streams
            if engine.was_step_applied():  # its clipping norm, compared as losses are (a skip keeps the last)
                norm = engine.get_global_grad_norm()
                result.setdefault("grad_norms", {})[str(step)] = math.nan if norm is None else float(norm)
            else:
                result["skipped"].append(step)
                if job.regather_after_skip:
                    persistent = engine.optimizer.persistent_parameters
                    persistent[0].all_gather(param_list=persistent)
            for event in job.events.get(str(step), []):
                seen = _between_steps(engine, scenario, event, step, rank, dtype)
                if seen:
                    result.setdefault("event_results", {}).setdefault(str(step), {}).update(seen)
            if job.guard:
                import z3guard

                z3guard.set_data_position(engine, {"next_step": step + 1})
            if step in job.save_at:
                limited = (job.fsize_limit is not None and step != job.save_at[0]
                           and job.fsize_rank in (None, rank))
                previous = limit_file_size(job.fsize_limit) if limited else None
                try:
                    began = time.perf_counter()
                    engine.save_checkpoint(job.save_dir.format(rank=rank), tag=job.save_tag or f"step{step}",
                                           client_state={"step": step})
                    result.setdefault("save_seconds", {})[str(step)] = time.perf_counter() - began
                except CheckpointError as exc:  # z3guard's: every rank failed the save alike
                    result["save_error"] = str(exc)
                    break
                except Exception as exc:  # stock's own: ends this rank, as it would end a user's script
                    raise SystemExit(f"save_checkpoint raised {type(exc).__name__}: {exc}") from exc
                finally:
                    if limited:
                        limit_file_size(previous)
            if job.track_memory and step % job.track_memory == 0:
                import psutil

                result.setdefault("rss", {})[str(step)] = psutil.Process().memory_info().rss
                if engine.device.type == "cuda":
                    result.setdefault("gpu_allocated", {})[str(step)] = torch.cuda.memory_allocated()
                    result.setdefault("gpu_reserved", {})[str(step)] = torch.cuda.memory_reserved()
            on_step(job.name, step)
    except Exception as exc:  # the trace failure under study, or another (reported, then the worker stops)
        crash = Crash.parse(step, exc, paths)
        result["crash"] = asdict(crash)
        if not crash.related:
            result["fatal"] = True
            try:
                engine.destroy()
            except Exception:  # the group is gone (z3guard aborts it when the ranks ran different modules)
                pass
            return result
    # Reads the scenario model saw handed an unfilled, still-gathering parameter (a race on its contents).
    result["inflight_reads"] = sum(getattr(m, "inflight_reads", 0) for m in engine.module.modules())
    result["data_read_steps"] = sorted({s for m in engine.module.modules() for s in getattr(m, "data_read_steps", ())})
    result["optimizer_sub_groups"] = len(getattr(engine.optimizer, "fp16_groups", []))  # stage 3's sub-groups
    if job.guard:
        import z3guard

        from ..adapter import leanhooks

        g = z3guard.guard(engine)
        result["divergences"] = [d.to_dict() for d in g.divergences]
        result["reads"] = [vars(r) for r in g.diagnostics.reads]
        result["restored"] = g.trace.restored
        result["fast_paths"] = g.fast_paths
        result["overflow_reads"] = dict(getattr(engine.optimizer, "z3guard_overflow_reads", {}))
        result["grad_offload"] = dict(getattr(engine.optimizer, "z3guard_grad_offload", {}))
        result["grads_written"] = dict(getattr(engine.optimizer, "z3guard_lazy_written", {}))  # hostgrads' notes
        result["persistent_kept"] = getattr(engine.optimizer, "z3guard_kept_gathered", None)  # in the last step
        result["foreach_copies"] = getattr(engine.optimizer, "z3guard_foreach_copies", 0)  # grad_bucket's
        result["batched_grads"] = getattr(engine.optimizer, "z3guard_batched", None)  # grad_batch's
        result["norm_graphs"] = sum(  # grad_norm's CUDA graphs, recorded and replayed
            v is not None for v in (getattr(engine.optimizer, "z3guard_norm_graphs", None) or {}).values())
        result["presigned_hooks"] = sum(  # ZeRO-3's per-module backward Functions whose signature is set
            "__signature__" in vars(f.forward) for f in leanhooks.module_hook_functions(engine.module))
        result["trace"] = {"switches": g.trace.cache.switches, "recordings": g.trace.cache.recordings,
                           "resyncs": g.trace.cache.resyncs, "cached": len(g.trace.cache)}
        result["read_pattern"] = [{"module": m, "param": p, **v} for (m, p), v in g.trace.read_pattern().items()]
        result["module_counts"] = g.trace.module_counts()
        result["forward_steps"] = g.trace.forward_steps
        g.checkpoint.write_back.wait()  # the last save on disk: from its start, how long that took
        result["durable_seconds"] = g.checkpoint.write_back.durable_seconds
    if result["crash"] is None and job.keep_state:
        result["state"] = {**gathered_state(engine, job.moments), **read}
        result["optimizer"] = optimizer_tensors(engine)
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        result["loss_scaler"] = {"scale": float(getattr(scaler, "cur_scale", 1.0)),
                                 "hysteresis": getattr(scaler, "cur_hysteresis", None)}
        result["lr"] = [float(x) for x in engine.get_lr()]
        result["rng"] = _consume_rng()
    engine.destroy()
    del hf_config  # transformers' ZeRO-3 switch stays on while the job runs
    return result


def _full_grads(engine, prefix: str) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 gradient as DeepSpeed's accessor gives it (collective)."""
    from deepspeed.utils import safe_get_full_grad

    return {f"{prefix}/{name}": safe_get_full_grad(p).detach().cpu().clone()
            for name, p in engine.module.named_parameters()}


def _halve_grads(engine) -> None:
    """A user's edit of the gradients between backward and step, through DeepSpeed's accessors."""
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    for p in engine.module.parameters():
        safe_set_full_grad(p, safe_get_full_grad(p) * 0.5)


def limit_file_size(limit: int) -> int:
    """Set this process's file-size limit (writes past it fail with EFBIG); returns the old one."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    return soft


def _consume_rng() -> list[float]:
    draws = [random.random(), float(np.random.rand()), torch.rand(1).item()]
    if torch.cuda.is_initialized():  # this rank's device's generator, where the run uses CUDA
        draws.append(torch.rand(1, device="cuda").item())
    return draws


def optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    """This rank's optimizer state (its partition), flattened to named tensors, padding zeroed."""
    out: dict[str, torch.Tensor] = {}
    padding = _partition_padding(engine)

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj.detach().cpu().clone()
            group = re.search(r"fp32_flat_groups\[(\d+)\]$|\.state\.(\d+)\.\w+$", prefix)
            mask = padding.get(int(next(g for g in group.groups() if g))) if group else None
            if mask is not None and mask.numel() == out[prefix].numel():
                out[prefix].view(-1)[mask] = 0
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}[{i}]", v)

    walk("optimizer", engine.optimizer.state_dict())
    return out


def _partition_padding(engine) -> dict[int, torch.Tensor]:
    """Per optimizer sub-group, where this rank's flat fp32 partition is padding: a parameter's tail past
    its numel when the ranks do not divide it evenly. Stage 3 never writes those elements, so two stock runs
    of one job differ there (at 3 ranks, say); they are not the model's state."""
    import torch.distributed as dist

    masks: dict[int, torch.Tensor] = {}
    for i, group in enumerate(getattr(engine.optimizer, "fp16_groups", [])):
        parts = []
        for p in group:
            size = p.partition_numel()
            start = dist.get_rank(group=p.ds_process_group) * size
            real = max(0, min(size, p.ds_numel - start))
            parts.append(torch.arange(size) >= real)
        if parts:
            masks[i] = torch.cat(parts)
    return masks


def _between_steps(engine, scenario, event: str, step: int, rank: int, dtype) -> dict | None:
    import deepspeed

    if event == "module-forward":  # as generate() runs: the module itself, outside engine.forward
        args, kwargs, _ = scenario.make_batch(step, 0, rank, dtype)
        args = tuple(a.to(engine.device) if torch.is_tensor(a) else a for a in args)
        states = [m.read_states for m in engine.module.modules() if hasattr(m, "read_states")]
        before = sum(map(len, states))
        with torch.no_grad():
            out = engine.module(*args, **kwargs).float().cpu()
            seen = [s for lst in states for s in lst][before:]  # the model's side reads in this forward
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                full = engine.module(*args, **kwargs).float().cpu()
        return {"module_forward_read_states": seen,
                "module_forward_equal": bool(out.shape == full.shape and torch.equal(out, full))}
    if event == "params-read":  # persistent parameters read through parameters(), outside any forward
        persistent = [p for p in engine.module.parameters() if getattr(p, "ds_persist", False)]
        seen = [p.detach().float().cpu().clone() for p in persistent]
        with deepspeed.zero.GatheredParameters(persistent):
            full = [p.detach().float().cpu().clone() for p in persistent]
        return {"params_read_equal": all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(seen, full))}
    if event == "gathered":
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            pass
    elif event == "partition":
        engine.empty_partition_cache()
    elif event == "eval":
        engine.eval()
        with torch.no_grad():
            args, kwargs, _ = scenario.make_batch(10_000 + step, 0, rank, dtype)
            engine(*(a.to(engine.device) if torch.is_tensor(a) else a for a in args), **kwargs)
        engine.train()
    else:
        raise ValueError(f"unknown event {event!r} (expected gathered, partition, eval, module-forward or params-read)")
    return None
