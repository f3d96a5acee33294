"""The guarded coordinator: DeepSpeed's own `PartitionedParameterCoordinator`, its class swapped on the
engine's instance (nothing else of it changes), with the crash fix's checks around its trace. The variants
below cover the lifecycles of the releases: which one an engine gets is decided from DeepSpeed's code
(lifecycle.py), never from its version string."""
from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable

from torch import nn

from deepspeed.runtime.zero.partitioned_param_coordinator import (PartitionedParameterCoordinator, ZeRoTraceMode,
                                                                  iter_params)

try:
    from deepspeed.utils import z3_leaf_module
except ImportError:  # before 0.13 there were no leaf modules
    def z3_leaf_module(module: nn.Module) -> bool:
        return False

from .base import TraceHooks
from .fingerprint import parameters

P = "_PartitionedParameterCoordinator__"  # name-mangled private state of the coordinator
KEEP = -7_919  # in a persistent parameter's ds_active_sub_modules while its module is released: kept


def release_of(coordinator: Any) -> Callable[[nn.Parameter], None]:
    """The coordinator's release of one parameter (partitioned unless a running module holds it). Before
    0.13 it also takes `backward`, which partition() ignores there."""
    release = getattr(coordinator, P + "release_param")
    if "backward" in _release_parameters():
        return functools.partial(release, backward=False)
    return release


@functools.cache
def _release_parameters() -> list[str]:
    """Read from the source as written: DeepSpeed's nvtx wrapper hides the signature."""
    return parameters("deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator."
                      "__release_param")


class GuardedCoordinator(PartitionedParameterCoordinator):
    """The stock coordinator plus: a parameter-set check before each fetch; on a module-order
    departure, a switch to another recorded trace that agrees (or recording the rest of this step, so
    that the new order is known next time); a tracing error turned into an invalidated trace."""

    z3guard_hooks: TraceHooks
    # Whether a departure may switch to another recorded trace (speedpaths "multi_trace"); without it a
    # departure invalidates the trace and re-records, as stock does. Set per instance by the adapter.
    multi_trace = False

    def reset_step(self) -> None:
        if self.z3guard_hooks.before_reset(self.is_record_trace() and self._recording_is_stale()):
            self._invalidate_trace()  # recorded again from this step on, as after any invalidation
        was_complete = self.is_complete_trace()
        super().reset_step()
        if self.is_complete_trace() and not was_complete:
            self.z3guard_hooks.on_trace_complete(tuple(getattr(self, P + "submodule_order")),
                                                 tuple(getattr(self, P + "param_order")))

    def _recording_is_stale(self) -> bool:
        """Whether the modules of the recording were numbered anew since it began. Hooks registered again on
        the root (DeepSpeed's `unwrap_model_for_generation`, TRL's `add_hooks` around `generate()`) renumber
        every module; stock then turns the recording into a trace by the new numbers, finds no fetch step
        for them and raises `IndexError: pop from an empty deque` (releases 0.15.4 to 0.19.1)."""
        fetched_for = getattr(self, P + "step_id_module_fetched_for")
        recorded = collections.Counter(_zero_id(m) for m in getattr(self, P + "submodule_order"))
        return any(len(fetched_for.get(i, ())) < n for i, n in recorded.items())

    def release_sub_module(self, submodule: nn.Module, *args, **kwargs) -> None:
        """While a trace is recorded, stock releases a module's persistent parameters with the rest (once
        it is complete, never): a later read of one from another module then finds it partitioned and
        gathers it on the reading rank alone, which on a read that depends on the rank's data is a
        collective the other ranks never join. Kept gathered here, as in every complete-trace step."""
        leaf = z3_leaf_module(submodule)
        if self.is_complete_trace() or (leaf and getattr(self, "fast_sharding_for_leaf_module", False)):
            # (with a granularity threshold stock empties a released leaf's data itself: left to stock)
            return super().release_sub_module(submodule, *args, **kwargs)
        kept = [p for p in iter_params(submodule, recurse=leaf) if getattr(p, "ds_persist", False)]
        for param in kept:
            param.ds_active_sub_modules.add(KEEP)
        try:
            super().release_sub_module(submodule, *args, **kwargs)
        finally:
            for param in kept:
                param.ds_active_sub_modules.discard(KEEP)

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
        release = release_of(self)
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
        # A leaf module's backward hooks can run on several autograd threads at once; DeepSpeed (0.18+)
        # serializes those fetches with a lock, and the checks and invalidation here take it too.
        concurrent = not forward and z3_leaf_module(current_submodule)
        with (getattr(self, P + "leaf_module_lock", None) if concurrent else None) or contextlib.nullcontext():
            complete = self.is_complete_trace()
            self.z3guard_hooks.before_fetch(current_submodule, forward, recording=not complete, once=concurrent)
            if complete and self.z3guard_hooks.param_divergence(current_submodule) is not None:
                self._invalidate_trace()  # the fetch below is then on demand, as in a recording step
        try:
            self._stock_fetch(current_submodule, forward)
        except RuntimeError as exc:
            self.z3guard_hooks.fetch_failed(exc)  # the ranks' verdict, where they ran different modules
            if "tracing error" not in str(exc) or not self.is_complete_trace():
                raise
            # The module's parameters are gathered already (DeepSpeed checks after the wait).
            self.z3guard_hooks.on_tracing_error(current_submodule, exc)
            self._invalidate_trace()
            setattr(self, P + "step_id", getattr(self, P + "step_id") + 1)


def _zero_id(module: nn.Module) -> int:
    """A module's ZeRO number: `ds_id` since 0.16.4, `id` before."""
    return getattr(module, "ds_id", getattr(module, "id", None))


class DrainingCoordinator(GuardedCoordinator):
    """Releases before 0.15.3: invalidating the trace leaves in-flight prefetches behind (and reset_step
    then refuses to run), so the guarded class waits for and releases them itself."""

    def _invalidate_trace(self) -> None:
        super()._invalidate_trace()
        registry = getattr(self, P + "inflight_param_registry")
        release = release_of(self)
        for param, handle in list(registry.items()):
            handle.wait()
            del registry[param]
            release(param)  # partitions it unless a running module still holds it


class ForwardlessCoordinator(DrainingCoordinator):
    """Releases before 0.10 (0.9.x): `fetch_sub_module` takes no `forward` flag."""

    def fetch_sub_module(self, current_submodule: nn.Module, forward: bool = True) -> None:
        super().fetch_sub_module(current_submodule, forward)

    def _stock_fetch(self, module: nn.Module, forward: bool) -> None:
        PartitionedParameterCoordinator.fetch_sub_module(self, module)
