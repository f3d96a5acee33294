"""The adapter: every contact of z3guard with DeepSpeed internals goes through here. What differs between
releases is read from DeepSpeed's code (lifecycle.py for the crash fix, speedpaths.py for the speed paths)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

import deepspeed
from deepspeed.runtime.zero import parameter_offload as _po
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, register_external_parameter
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from . import blockfetch, gathered, leanhooks, quietmodules, reshard, speedpaths
from .base import EngineHook, ReadHook, TraceHooks
from .coordinator import P, z3_leaf_module
from .leanhooks import is_compiling as _is_compiling
from .lifecycle import Lifecycle


S3 = "_DeepSpeedZeroOptimizer_Stage3__"  # ... and of stage 3's optimizer
# The root module of every guarded ZeRO-3 model. DeepSpeed pushes each onto its stack of running modules
# once at set-up, for good, and again when its forward runs.
_ROOTS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _running_forward() -> nn.Module | None:
    """The module whose forward runs now, by DeepSpeed's stack; None outside every hooked forward: only the
    entries a set-up left are there (a read in the training loop, or in generate() while the hooks are
    removed, as DeepSpeed's and TRL's unwrap_model_for_generation do)."""
    stack = _po.FWD_MODULE_STACK
    if not stack:
        return None
    top = stack[-1]
    if top in _ROOTS and sum(m is top for m in stack) == 1:
        return None
    return top


def _subtree(module: nn.Module) -> list[nn.Module]:
    """`module` and every module below it, each once."""
    found, todo, seen = [], [module], set()
    while todo:
        m = todo.pop()
        if id(m) not in seen:
            seen.add(id(m))
            found.append(m)
            todo.extend(c for c in dict.values(m._modules) if c is not None)
    return found


class ZeroAdapter:
    """What z3guard may do to DeepSpeed, for the lifecycle the installed release has."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle
        self.guarded_class = lifecycle.guarded_class
        self._saved: dict[str, Any] = {}

    # -- global patches --------------------------------------------------------------------
    def patch_globals(self, on_read: ReadHook, on_engine: EngineHook,
                      build_options: Callable[[], Any] = lambda: None) -> None:
        if self._saved:
            return
        original_getitem = _po.ZeROOrderedDict.__getitem__
        own_items = vars(_po.ZeROOrderedDict).get("items")  # DeepSpeed's, if a release defines one
        original_items = _po.ZeROOrderedDict.items
        original_initialize = deepspeed.initialize
        original_offload_init = _po.DeepSpeedZeRoOffload.__init__

        def __getitem__(self, key):
            # Any module's forward, not only inside engine.forward (stock's getter): generate() on the module,
            # an activation-checkpoint recompute, an eval forward through the module itself.
            param = dict.__getitem__(self, key)
            if param is not None and hasattr(param, "ds_status") and not _is_compiling():
                running = _running_forward()
                if running is not None and running is not self._parent_module:
                    on_read(running, param, self._in_forward, self._parent_module)
            return original_getitem(self, key)

        def items(self):
            # parameters(), named_parameters() and state_dict() go through here, not through __getitem__:
            # another module's parameter in flight is waited for (stock hands out its unfilled buffer). Not
            # for a leaf module: ZeRO-3 fetches its whole subtree, through here, before its forward.
            for param in dict.values(self):
                if param is not None and getattr(param, "ds_status", None) is ZeroParamStatus.INFLIGHT:
                    running = _running_forward()
                    if (running is not None and running is not self._parent_module and not _is_compiling()
                            and not z3_leaf_module(running)):
                        if on_read(running, param, self._in_forward, self._parent_module, raw=True):
                            setattr(param, gathered.WAITED, True)
            return original_items(self)

        def initialize(*args, **kwargs):
            result = original_initialize(*args, **kwargs)
            on_engine(result[0])
            return result

        @functools.wraps(original_offload_init)
        def offload_init(offload, module, *args, **kwargs):  # around ZeRO-3's registration of module hooks
            options = build_options()
            fast = options is not None and options.fast_paths
            if fast and options.fast_block_fetch and speedpaths.allowed("block_fetch"):
                settings = inspect.signature(original_offload_init).bind(offload, module, *args, **kwargs)
                settings.apply_defaults()
                blockfetch.before_hooks(module, settings.arguments)
            original_offload_init(offload, module, *args, **kwargs)
            blockfetch.after_hooks(module)  # before the optimizer's gradient hooks: stock's, per parameter
            if fast and options.fast_hook_calls and speedpaths.allowed("quiet_modules"):
                try:
                    quietmodules.quiet(offload, module)
                except Exception as exc:  # this path alone stays off; the hooks that stayed are stock's
                    speedpaths.say_off("quiet_modules", f"here: {exc}", logging.WARNING)

        def read_in_forward(param) -> bool:  # a GatheredParameters context entered inside a forward
            running = _running_forward()
            return running is not None and on_read(running, param, True, None)

        initialize.__wrapped__ = original_initialize
        self._saved = {"getitem": original_getitem, "items": own_items, "initialize": original_initialize,
                       "offload_init": original_offload_init, "gathered": gathered.patch(read_in_forward)}
        _po.ZeROOrderedDict.__getitem__ = __getitem__
        _po.ZeROOrderedDict.items = items
        deepspeed.initialize = initialize
        _po.DeepSpeedZeRoOffload.__init__ = offload_init

    def unpatch_globals(self) -> None:
        leanhooks.remove()
        if not self._saved:
            return
        _po.ZeROOrderedDict.__getitem__ = self._saved["getitem"]
        if self._saved["items"] is None:
            del _po.ZeROOrderedDict.items  # OrderedDict's again
        else:
            _po.ZeROOrderedDict.items = self._saved["items"]
        deepspeed.initialize = self._saved["initialize"]
        _po.DeepSpeedZeRoOffload.__init__ = self._saved["offload_init"]
        self._saved["gathered"]()
        self._saved = {}

    # -- engine and parameters -------------------------------------------------------------
    def offload(self, engine: Any):
        opt = getattr(engine, "optimizer", None)
        if isinstance(opt, _po.DeepSpeedZeRoOffload):
            return opt
        return getattr(opt, "parameter_offload", None)

    def is_zero3(self, engine: Any) -> bool:
        return self.offload(engine) is not None

    def hooks_installed(self, engine: Any) -> bool:
        """Whether the engine's module hooks are in place: `unwrap_model_for_generation` (DeepSpeed's, TRL's)
        removes them around generate(), and ZeRO-3 then gathers nothing itself."""
        hooks = getattr(self.offload(engine), "forward_hooks", None)
        return hooks is None or bool(hooks)

    def process_group(self, engine: Any) -> Any:
        """The group ZeRO-3 gathers the parameters over (its data-parallel ranks); None: the world."""
        first = next(iter(engine.module.parameters()), None)
        return getattr(first, "ds_process_group", None)

    def persistent_params(self, engine: Any) -> list[nn.Parameter]:
        return list(self.offload(engine).persistent_parameters)

    def gather(self, params: list[nn.Parameter]) -> None:
        """One coalesced all-gather; on CPU one parameter per all-gather: before 0.19 the coalesced gather
        waits for the last of its gloo all-gathers only, and where its closing synchronize does nothing
        the others may still be writing. A single parameter's gather blocks until it is done."""
        from deepspeed.accelerator import get_accelerator

        if not params:
            return
        if get_accelerator().device_name() != "cpu":
            params[0].all_gather(param_list=params)
            return
        for param in params:
            param.all_gather(param_list=[param])

    def is_gathered(self, param: nn.Parameter) -> bool:
        return param.ds_status != ZeroParamStatus.NOT_AVAILABLE

    def module_params(self, module: nn.Module) -> dict[int, nn.Parameter]:
        """What ZeRO-3 fetches for `module` (`iter_params(module, recurse=is_leaf)`), by id. Checked
        before every fetch, so the set is read from the modules' dicts directly: the same set as
        `named_parameters(recurse=is_leaf)` plus the module's external parameters, at a fraction of the
        cost (no generators, no names, and none of ZeROOrderedDict.items' checks)."""
        params: dict[int, nn.Parameter] = {}
        for m in _subtree(module) if z3_leaf_module(module) else (module,):
            params.update((id(p), p) for p in dict.values(m._parameters) if p is not None)
        external = module.__dict__.get("_external_params")
        if external:
            params.update((id(p), p) for p in external.values())
        return params

    def owns(self, module: nn.Module, param: nn.Parameter) -> bool:
        """True when `param` is already among what ZeRO-3 fetches for `module`."""
        if blockfetch.block_of(param) is module:
            return True
        return id(param) in getattr(module, "_external_params", {}) or any(
            p is param for p in dict.values(module._parameters))

    def register_external(self, module: nn.Module, param: nn.Parameter) -> None:
        register_external_parameter(module, param)

    def fetch_read(self, module: nn.Module, param: nn.Parameter) -> None:
        """What stock's getter does for a partitioned parameter read inside engine.forward: register it with
        the reading module (released with it) and gather it now."""
        register_external_parameter(module, param)
        param.all_gather()

    def inflight_registries(self, engine: Any) -> list[dict]:
        if not self.lifecycle.registry_on_module:
            return [getattr(c, P + "inflight_param_registry") for c in self.coordinators(engine)]
        registry = engine.module.ds_inflight_param_registry
        return list(registry.values()) if self.lifecycle.coordinator_per_mode else [registry]

    def wait_if_inflight(self, engine: Any, param: nn.Parameter) -> None:
        """A read of a parameter that is being prefetched for another module must wait for it: stock
        ZeRO-3 gathers only NOT_AVAILABLE ones and hands out the unfilled buffer of an INFLIGHT one."""
        if param.ds_status == ZeroParamStatus.INFLIGHT:
            for registry in self.inflight_registries(engine):
                if param in registry:
                    registry.pop(param).wait()

    def loss_scaler_state(self, engine: Any) -> dict[str, Any]:
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        return {"scale": float(getattr(scaler, "cur_scale", 1.0)),
                "hysteresis": getattr(scaler, "cur_hysteresis", None),
                "dynamic": bool(getattr(scaler, "dynamic", False))}

    @contextlib.contextmanager
    def guarded_writes(self, engine: Any, open_file: Callable[[str], Any]) -> Iterator[list[Exception]]:
        """DeepSpeed's save writes through `engine.checkpoint_engine.save(state_dict, path)` between
        collectives of its own; a write failing on one rank would leave the others waiting in them. Inside
        this, a failed write is kept (and later writes skipped) while the save goes on to its end; the
        caller raises it then. DeepSpeed's plain torch writer (which hands `path` to `torch.save`) is given
        `open_file(path)` instead, a file object that hashes the bytes as they pass; other writers (fast,
        decoupled, Nebula) get the path."""
        writer = engine.checkpoint_engine
        errors: list[Exception] = []
        shadowed = vars(writer).get("save")
        stock = writer.save
        plain = type(writer).__name__ == "TorchCheckpointEngine" and shadowed is None

        def save(state_dict: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
            if errors:
                return None
            try:
                if not (plain and isinstance(path, (str, os.PathLike))):
                    return stock(state_dict, path, *args, **kwargs)
                target = open_file(os.fspath(path))
                try:
                    return stock(state_dict, target, *args, **kwargs)
                finally:
                    target.close()
            except Exception as exc:  # torch.save reports a failed write as RuntimeError, not OSError
                errors.append(exc)
                return None

        writer.save = save
        try:
            yield errors
        finally:
            if shadowed is None:
                del writer.save
            else:
                writer.save = shadowed

    def node_local_storage(self, engine: Any) -> bool:
        """DeepSpeed's `checkpoint.use_node_local_storage`: each node saves to and loads from its own disk."""
        return bool(getattr(engine, "use_node_local_storage", lambda: False)())

    # -- a checkpoint saved on another number of ranks (reshard.py) -------------------------
    def saved_layout(self, folder: Any) -> Any:
        return reshard.read_layout(folder)

    def reshard_problems(self, layout: Any, engine: Any, names: dict[int, str]) -> list[str]:
        missing = [n for n in ("_get_ckpt_name", "_load_zero_checkpoint", "zero_load_from_fp32_weights")
                   if not hasattr(engine, n)]
        missing += [n for n in ("fp16_groups", "fp32_partitioned_groups_flat", "dp_process_group")
                    if not hasattr(engine.optimizer, n)]
        if missing:
            return [f"this DeepSpeed lacks {', '.join(missing)}, which re-partitioning reads"]
        return reshard.problems(layout, engine, names)

    def resharding(self, engine: Any, layout: Any) -> Any:
        return reshard.loading_from(engine, layout)

    def saves_asynchronously(self, engine: Any) -> bool:
        """A decoupled checkpoint engine (0.19) writes, and writes `latest`, after `save_checkpoint` returns."""
        writer = getattr(engine, "checkpoint_engine", None)
        return bool(getattr(writer, "is_decoupled", lambda: False)())

    def apply_fast_paths(self, engine: Any, options: Any) -> list[str]:
        """The speed paths whose stock code is the code they were verified on (speedpaths.py), as enabled."""
        from . import fastpaths

        blocks = blockfetch.marked(engine.module)  # fetched whole since the engine was built
        quiet = quietmodules.quieted(engine.module)  # without ZeRO-3's hooks since the engine was built
        applied = [f"{name}={n}" for name, n in (("block_fetch", blocks), ("quiet_modules", quiet)) if n]
        if not options.fast_paths or engine.optimizer is None or not hasattr(engine.optimizer, "parameter_offload"):
            return applied
        ok = speedpaths.allowed
        if options.fast_hook_calls and ok("lean_hooks"):
            try:  # process-wide; undone with the global patches
                leanhooks.apply()
                leanhooks.presign_module_hooks(engine.module)
                applied.append("lean_hooks")
            except Exception as exc:  # this path alone stays off; the guard and the other paths go on
                speedpaths.say_off("lean_hooks", f"here: {exc}", logging.WARNING)
        return applied + fastpaths.apply(
            engine, options.fast_writeback and ok("writeback"), options.fast_overflow_check and ok("overflow_check"),
            options.host_threads if ok("host_threads") else 0, options.fast_persistent_gather and ok("persistent_gather"),
            options.fast_fused_step and ok("fused_step"), options.fast_grad_offload and ok("grad_offload"),
            grads_on_host=ok("grads_cast_on_host"), grad_bucket=options.fast_hook_calls and ok("grad_bucket"),
            grad_norm=options.fast_grad_norm and ok("grad_norm"), grad_batch=options.fast_hook_calls and ok("grad_batch"))

    def remove_fast_paths(self, engine: Any) -> None:
        from . import fastpaths

        if engine.optimizer is not None and hasattr(engine.optimizer, "parameter_offload"):
            fastpaths.remove(engine)

    # -- the coordinator -------------------------------------------------------------------
    def coordinators(self, engine: Any) -> list[PartitionedParameterCoordinator]:
        offload = self.offload(engine)
        if self.lifecycle.coordinator_per_mode:  # created on first use, one per mode
            return [offload.get_param_coordinator(training=mode) for mode in (True, False)]
        return [offload.get_param_coordinator()]

    def count_invalidations(self, engine: Any) -> Callable[[], int]:
        """Instrument `engine` (guarded or not) to count trace invalidations, for the benchmarks."""
        count = [0]
        for c in self.coordinators(engine):
            def counting(original=c._invalidate_trace) -> None:
                count[0] += 1
                original()

            c._invalidate_trace = counting
        return lambda: count[0]

    def guard_coordinator(self, engine: Any, hooks: TraceHooks, multi_trace: bool = True) -> None:
        switch = multi_trace and speedpaths.allowed("multi_trace")
        _ROOTS.add(self.offload(engine).module)
        for c in self.coordinators(engine):
            c.z3guard_hooks = hooks
            c.multi_trace = switch
            c.__class__ = self.guarded_class

    def unguard_coordinator(self, engine: Any) -> None:
        for c in self.coordinators(engine):
            if isinstance(c, self.guarded_class):
                c.__class__ = PartitionedParameterCoordinator
                vars(c).pop("multi_trace", None)
