"""Code shared by the release adapters: what stayed the same across the supported DeepSpeed releases."""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import torch
from torch import nn

import deepspeed
from deepspeed.runtime.zero import parameter_offload as _po
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, register_external_parameter
from deepspeed.runtime.zero.partitioned_param_coordinator import (PartitionedParameterCoordinator, ZeRoTraceMode,
                                                                  iter_params)
try:
    from deepspeed.utils import z3_leaf_module
except ImportError:  # before 0.13 there were no leaf modules
    def z3_leaf_module(module: nn.Module) -> bool:
        return False

from . import blockfetch
from .base import EngineHook, ReadHook, TraceHooks

# torch.compiler.is_compiling arrived in torch 2.3; before it, torch._dynamo's
_is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling

P = "_PartitionedParameterCoordinator__"  # name-mangled private state of the coordinator
S3 = "_DeepSpeedZeroOptimizer_Stage3__"  # ... and of stage 3's optimizer


class GuardedCoordinator(PartitionedParameterCoordinator):
    """The stock coordinator plus: a parameter-set check before each fetch; on a module-order
    departure, a switch to another recorded trace that agrees (or recording the rest of this step, so
    that the new order is known next time); a tracing error turned into an invalidated trace."""

    z3guard_hooks: TraceHooks
    multi_trace = True  # releases whose trace switching was checked bit for bit

    def reset_step(self) -> None:
        was_complete = self.is_complete_trace()
        super().reset_step()
        if self.is_complete_trace() and not was_complete:
            self.z3guard_hooks.on_trace_complete(tuple(getattr(self, P + "submodule_order")),
                                                 tuple(getattr(self, P + "param_order")))

    def trace_prologue(self, sub_module: nn.Module) -> None:
        if self.is_complete_trace():
            order = getattr(self, P + "submodule_order")
            step = getattr(self, P + "step_id")
            expected = order[step] if step < len(order) else None
            if expected is not sub_module:
                ran = tuple(order[:step])
                trace = self.z3guard_hooks.order_divergence(step, expected, sub_module,
                                                            ran if self.multi_trace else None)
                if trace is not None:
                    self._follow(trace.modules, trace.params, step)
                    return
                super().trace_prologue(sub_module)  # invalidates
                if self.multi_trace:
                    self._record_from(ran)
                return
        super().trace_prologue(sub_module)

    def _stock_fetch(self, module: nn.Module, forward: bool) -> None:
        PartitionedParameterCoordinator.fetch_sub_module(self, module, forward)

    def _follow(self, modules: tuple, params: tuple, step: int) -> None:
        """Continue this step on another recorded trace, from position `step` (the running module's)."""
        setattr(self, P + "submodule_order", modules)
        setattr(self, P + "param_order", params)
        queue = collections.deque(e for e in params if e.step_id_last_used_at >= step)
        setattr(self, P + "param_queue", queue)
        recent = getattr(self, P + "most_recent_step_id_param_fetched_for")
        for param in [p for p, s in recent.items() if s >= step]:
            del recent[param]  # prefetch bookkeeping of the abandoned trace's future
        needed = {e.param for e in queue}
        registry = getattr(self, P + "inflight_param_registry")
        release = getattr(self, P + "release_param")
        for param in [p for p in registry if p not in needed]:  # prefetched in vain: released at once
            registry.pop(param).wait()
            release(param)
        # DeepSpeed's release decisions stay cached by (module, position) across traces: recomputing
        # them after every switch walks the rest of the trace per module (seconds per step on GPT-2
        # medium, measured). A stale entry can only release a parameter early (it is fetched again)
        # or late (partitioned at the optimizer step), never change a result.

    def _record_from(self, ran: tuple) -> None:
        """After an invalidation mid-step: record the rest of this step on top of what already ran."""
        setattr(self, P + "trace_mode", ZeRoTraceMode.RECORD)
        setattr(self, P + "submodule_order", list(ran))
        fetched_for = getattr(self, P + "step_id_module_fetched_for")
        for position, module in enumerate(ran):
            fetched_for[module.ds_id].append(position)

    def fetch_sub_module(self, current_submodule: nn.Module, forward: bool) -> None:
        if self.is_complete_trace() and self.z3guard_hooks.param_divergence(current_submodule) is not None:
            self._invalidate_trace()  # the fetch below is then on demand, as in a recording step
        try:
            self._stock_fetch(current_submodule, forward)
        except RuntimeError as exc:
            if "tracing error" not in str(exc) or not self.is_complete_trace():
                raise
            # The module's parameters are gathered already (DeepSpeed checks after the wait).
            self.z3guard_hooks.on_tracing_error(current_submodule, exc)
            self._invalidate_trace()
            setattr(self, P + "step_id", getattr(self, P + "step_id") + 1)


class ZeroAdapter:
    """Everything but the coordinator's lifecycle, which differs between releases."""

    guarded_class: type = GuardedCoordinator
    fetches_blocks = False  # whole-block fetch (blockfetch.py): on the releases where it was checked

    def __init__(self) -> None:
        self._saved: dict[str, Any] = {}

    # -- global patches --------------------------------------------------------------------
    def patch_globals(self, on_read: ReadHook, on_engine: EngineHook,
                      fetch_blocks: Callable[[], bool] = lambda: False) -> None:
        if self._saved:
            return
        original_getitem = _po.ZeROOrderedDict.__getitem__
        original_initialize = deepspeed.initialize
        original_offload_init = _po.DeepSpeedZeRoOffload.__init__
        marks_blocks = self.fetches_blocks

        def __getitem__(self, key):
            param = dict.__getitem__(self, key)
            if param is not None and self._in_forward and hasattr(param, "ds_status") and _po.FWD_MODULE_STACK \
                    and not _is_compiling():
                running = _po.FWD_MODULE_STACK[-1]
                if running is not self._parent_module:
                    on_read(running, param)
            return original_getitem(self, key)

        def initialize(*args, **kwargs):
            result = original_initialize(*args, **kwargs)
            on_engine(result[0])
            return result

        @functools.wraps(original_offload_init)
        def offload_init(offload, module, *args, **kwargs):  # before ZeRO-3 registers its module hooks
            if marks_blocks and fetch_blocks():
                settings = inspect.signature(original_offload_init).bind(offload, module, *args, **kwargs)
                settings.apply_defaults()
                blockfetch.before_hooks(module, settings.arguments)
            original_offload_init(offload, module, *args, **kwargs)

        initialize.__wrapped__ = original_initialize
        self._saved = {"getitem": original_getitem, "initialize": original_initialize,
                       "offload_init": original_offload_init}
        _po.ZeROOrderedDict.__getitem__ = __getitem__
        deepspeed.initialize = initialize
        _po.DeepSpeedZeRoOffload.__init__ = offload_init

    def unpatch_globals(self) -> None:
        if not self._saved:
            return
        _po.ZeROOrderedDict.__getitem__ = self._saved["getitem"]
        deepspeed.initialize = self._saved["initialize"]
        _po.DeepSpeedZeRoOffload.__init__ = self._saved["offload_init"]
        self._saved = {}

    # -- engine and parameters -------------------------------------------------------------
    def offload(self, engine: Any):
        opt = getattr(engine, "optimizer", None)
        if isinstance(opt, _po.DeepSpeedZeRoOffload):
            return opt
        return getattr(opt, "parameter_offload", None)

    def is_zero3(self, engine: Any) -> bool:
        return self.offload(engine) is not None

    def persistent_params(self, engine: Any) -> list[nn.Parameter]:
        return list(self.offload(engine).persistent_parameters)

    def gather(self, params: list[nn.Parameter]) -> None:
        if params:
            params[0].all_gather(param_list=params)

    def is_gathered(self, param: nn.Parameter) -> bool:
        return param.ds_status != ZeroParamStatus.NOT_AVAILABLE

    def module_params(self, module: nn.Module) -> dict[int, nn.Parameter]:
        """What ZeRO-3 fetches for `module` (`iter_params(module, recurse=is_leaf)`), by id. Checked
        before every fetch, so a plain module's set is read from its two dicts directly: the same set
        as `named_parameters(recurse=False)` plus its external parameters, at a fraction of the cost."""
        if z3_leaf_module(module):
            return {id(p): p for p in iter_params(module, recurse=True)}
        params = {id(p): p for p in module._parameters.values() if p is not None}
        external = module.__dict__.get("_external_params")
        if external:
            params.update((id(p), p) for p in external.values())
        return params

    def owns(self, module: nn.Module, param: nn.Parameter) -> bool:
        """True when `param` is already among what ZeRO-3 fetches for `module`."""
        if getattr(param, "ds_z3_leaf_module", None) is module:
            return True
        return id(param) in getattr(module, "_external_params", {}) or any(
            p is param for p in dict.values(module._parameters))

    def register_external(self, module: nn.Module, param: nn.Parameter) -> None:
        register_external_parameter(module, param)

    def inflight_registries(self, engine: Any) -> list[dict]:
        raise NotImplementedError

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
    def deferred_write_errors(self, engine: Any) -> Iterator[list[Exception]]:
        """DeepSpeed's save writes through `engine.checkpoint_engine.save` between collectives of its own; a
        write failing on one rank would leave the others waiting in them. Inside this, a failed write is
        kept (and later writes skipped) while the save goes on to its end; the caller raises it then."""
        writer = engine.checkpoint_engine
        errors: list[Exception] = []
        shadowed = vars(writer).get("save")
        stock = writer.save

        def save(*args: Any, **kwargs: Any) -> Any:
            if errors:
                return None
            try:
                return stock(*args, **kwargs)
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

    def saves_asynchronously(self, engine: Any) -> bool:
        """A decoupled checkpoint engine (0.19) writes, and writes `latest`, after `save_checkpoint` returns."""
        writer = getattr(engine, "checkpoint_engine", None)
        return bool(getattr(writer, "is_decoupled", lambda: False)())

    def apply_fast_paths(self, engine: Any, options: Any) -> list[str]:
        return []  # only where a release's hot paths were checked bit for bit (see v0_19)

    def remove_fast_paths(self, engine: Any) -> None:
        pass

    # -- the coordinator -------------------------------------------------------------------
    def coordinators(self, engine: Any) -> list[PartitionedParameterCoordinator]:
        raise NotImplementedError

    def count_invalidations(self, engine: Any) -> Callable[[], int]:
        """Instrument `engine` (guarded or not) to count trace invalidations, for the benchmarks."""
        count = [0]
        for c in self.coordinators(engine):
            def counting(original=c._invalidate_trace) -> None:
                count[0] += 1
                original()

            c._invalidate_trace = counting
        return lambda: count[0]

    def guard_coordinator(self, engine: Any, hooks: TraceHooks) -> None:
        for c in self.coordinators(engine):
            c.z3guard_hooks = hooks
            c.__class__ = self.guarded_class

    def unguard_coordinator(self, engine: Any) -> None:
        for c in self.coordinators(engine):
            if isinstance(c, self.guarded_class):
                c.__class__ = PartitionedParameterCoordinator
