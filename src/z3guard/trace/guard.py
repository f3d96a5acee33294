"""Per-engine trace guard: keeps persistent parameters in one state, validates and recovers."""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from ..diagnose import CrossModuleRead, Diagnostics, Divergence, Names
from .agreement import RankAgreement
from .cache import Trace, TraceCache
from .lockstep import Lockstep
from .registration import GUARDS


class TraceGuard:
    """Answers the guarded coordinator's questions for one engine (see `adapter.base.TraceHooks`)."""

    def __init__(self, engine: Any, adapter: Any, names: Names, diagnostics: Diagnostics,
                 lockstep_timeout: float = 600.0):
        self.engine = engine
        self.adapter = adapter
        self.names = names
        self.diagnostics = diagnostics
        self.recorded: dict[int, dict[int, nn.Parameter]] = {}  # id(module) -> {id(param): param}
        self.persistent = adapter.persistent_params(engine)
        self.restored = 0  # persistent parameters re-gathered at the start of a step
        self.cache = TraceCache()
        # (reading module, parameter) -> [steps seen, first step, last step]: reads on some steps only
        self.read_steps: dict[tuple[int, int], list[int]] = {}
        self.forward_steps = 0  # steps that ran a forward (a count: a set would grow with the run)
        self._last_forward_step = -1
        # reads noted since the last step boundary, registered on every rank there (agreement.py)
        self.pending: dict[tuple[int, int], tuple[nn.Module, nn.Parameter, str | None]] = {}
        self.agreement = RankAgreement(adapter.process_group(engine))
        self._modules = list(engine.module.modules())  # the same order on every rank: the same model
        self._params = list(engine.module.parameters())
        self._module_index = {id(m): i for i, m in enumerate(self._modules)}
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        self.lockstep = Lockstep(adapter.process_group(engine), lockstep_timeout, self._describe)
        self._fetched_once: list[list] = []  # leaf modules' backward fetches since the boundary
        for m in engine.module.modules():
            GUARDS[m] = self
        self._hook = engine.module.register_forward_pre_hook(self._restore_persistent, prepend=True)
        self._engine_step = engine.step
        engine.step = self._step

    def remove(self) -> None:
        self.lockstep.close()
        if vars(self.engine).get("step") == self._step:
            del self.engine.step
        self._hook.remove()
        for m in self.engine.module.modules():
            GUARDS.pop(m, None)

    @property
    def step(self) -> int:
        return int(getattr(self.engine, "global_steps", 0)) + 1

    def _restore_persistent(self, module: nn.Module, args: Any) -> None:
        """Every step starts with persistent parameters gathered, whatever came before: a skipped
        step, GatheredParameters, an explicit partition, a checkpoint load. Stock DeepSpeed
        re-gathers them only at the end of an applied step."""
        if self.step != self._last_forward_step:
            self._last_forward_step = self.step
            self.forward_steps += 1
        self._gather_persistent()

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        """engine.step, then persistent parameters gathered again where the step left them partitioned (a
        skipped step: stock re-gathers them only after an applied one), so that a read between steps,
        through `parameters()` or `state_dict()` too, sees them whole. All ranks skip together."""
        result = self._engine_step(*args, **kwargs)
        self._gather_persistent()
        return result

    def _gather_persistent(self) -> None:
        missing = [p for p in self.persistent if not self.adapter.is_gathered(p)]
        if missing:
            self.adapter.gather(missing)
            self.restored += len(missing)

    # -- TraceHooks ------------------------------------------------------------------------
    def before_reset(self, stale: bool = False) -> bool:
        """Register, on every rank, every read any rank noted since the last boundary; and tell whether any
        rank's recording is stale (its modules were numbered anew since it began), so that all drop it."""
        self.lockstep.at_boundary()
        self._fetched_once.clear()
        sources = {(self._module_index[id(m)], self._param_index[id(p)]): s for m, p, s in self.pending.values()
                   if id(m) in self._module_index and id(p) in self._param_index}
        self.pending.clear()
        reads, stale = self.agreement.union(list(sources), stale)
        if stale:
            self.diagnostics.add(Divergence(
                "renumbered", self.step, "<root>",
                cause="hooks removed and added again between steps (DeepSpeed's unwrap_model_for_generation or "
                      "TRL's add_hooks around generate()) numbered every module anew; stock DeepSpeed 0.15.4-0.19.1 "
                      "raises IndexError: pop from an empty deque here",
                fix="DeepSpeed >= 0.19.2, or call the coordinator's _invalidate_trace() after adding the hooks "
                    "(TRL >= 1.5 does)"))
        for mi, pi in reads:
            module, param = self._modules[mi], self._params[pi]
            if not self.adapter.owns(module, param):  # stock registers a read it found partitioned itself
                self.adapter.register_external(module, param)
            self.note_read(module, param, sources.get((mi, pi)))
        return stale

    def before_fetch(self, module: nn.Module, forward: bool, recording: bool, once: bool = False) -> None:
        if not self.lockstep.active:  # one rank: nothing to agree on
            return
        # A forward without gradients (evaluation, generate()) is told apart: one on some ranks only (samples
        # generated on rank 0 alone) must not pass for the others' training forward.
        kind = ("fwd" if torch.is_grad_enabled() else "fwd-nograd") if forward else "bwd"
        event = [kind, self._module_index.get(id(module), -1)]
        if once:  # threads race to fetch it: the ranks may see one call or two
            if event in self._fetched_once:
                return
            self._fetched_once.append(event)
        if recording:  # no recorded order to leave: every fetch is checked
            self.lockstep.agree(event)
        else:
            self.lockstep.note(event)

    def fetch_failed(self, error: BaseException) -> None:
        self.lockstep.raise_if_decided(error)

    def before_first_read(self, running: nn.Module, param: nn.Parameter) -> None:
        """A read of a partitioned parameter from another module: stock gathers it at once, a collective
        that every rank must make."""
        self.lockstep.agree(["read", self._module_index.get(id(running), -1), self._param_index.get(id(param), -1)])

    def _describe(self, event: list | None) -> str:
        if event is None:
            return "had ended the step"
        kind, mi, *rest = event
        module = f"`{self.names.module(self._modules[mi])}`" if 0 <= mi < len(self._modules) else "a module"
        if kind == "read":
            pi = rest[0]
            param = f"`{self.names.param(self._params[pi])}`" if 0 <= pi < len(self._params) else "a parameter"
            return f"read {param} in {module}'s forward"
        return {"fwd": f"ran {module}'s forward", "fwd-nograd": f"ran {module}'s forward without gradients "
                "(evaluation, generate())", "bwd": f"ran {module}'s backward",
                "run": f"ran {module} outside the recorded order", "params": f"found new parameters in {module}",
                "tracing-error": f"found {module}'s fetch out of order"}.get(kind, f"{kind} {module}")

    def defer_read(self, running: nn.Module, param: nn.Parameter, source: str | None) -> None:
        self.pending.setdefault((id(running), id(param)), (running, param, source))

    def on_trace_complete(self, modules: tuple[nn.Module, ...], params: tuple) -> None:
        self.recorded.update({id(m): self.adapter.module_params(m) for m in modules})
        self.cache.add(Trace(modules, params))

    def param_divergence(self, module: nn.Module) -> Divergence | None:
        recorded = self.recorded.get(id(module))
        if recorded is None:
            return None  # not in the trace: the order check reports it
        now = self.adapter.module_params(module)
        if now.keys() == recorded.keys():
            return None
        self.lockstep.agree(["params", self._module_index.get(id(module), -1)])
        added = [p for k, p in now.items() if k not in recorded]
        removed = [p for k, p in recorded.items() if k not in now]
        path = self.names.module(module)
        foreign = [p for p in added if not any(p is q for q in dict.values(module._parameters))]
        if foreign:
            cause = ("parameters of other modules were first read by this module's forward after the trace "
                     "was recorded (a read that happens only on some steps, or one stock ZeRO-3 missed "
                     "because the parameter was gathered when the trace was recorded)")
        else:
            cause = "the module's own parameters changed after the trace was recorded"
        fix = "; ".join(f"deepspeed.zero.register_external_parameter({self.names.attr_path(path)}, "
                        f"{self.names.attr_path(self.names.param(p))})" for p in foreign)
        d = Divergence("param-set", self.step, path, tuple(sorted(self.names.param(p) for p in added)),
                       tuple(sorted(self.names.param(p) for p in removed)), cause=cause, fix=fix)
        self.diagnostics.add(d)
        self.recorded.clear()
        self.cache.clear()  # every recorded trace holds the old parameter set
        return d

    def order_divergence(self, position: int, expected: nn.Module | None, got: nn.Module,
                         ran: tuple[nn.Module, ...] | None) -> Trace | None:
        self.lockstep.agree(["run", self._module_index.get(id(got), -1)])
        if ran is not None:
            trace = self.cache.agreeing(ran, got)
            if trace is not None:
                return trace  # a known order: no warning, prefetch goes on
        self.diagnostics.add(Divergence(
            "order", self.step, self.names.module(got), expected=self.names.module(expected),
            cause=f"the module order departs from the recorded trace at position {position} "
                  "(control flow that differs between steps: a skipped block, routing, a new branch)",
            fix="make the module order the same on every step, or mark the varying part a leaf with "
                "deepspeed.utils.set_z3_leaf_modules"))
        return None

    def on_tracing_error(self, module: nn.Module, error: RuntimeError) -> None:
        self.lockstep.agree(["tracing-error", self._module_index.get(id(module), -1)])
        self.diagnostics.add(Divergence(
            "tracing-error", self.step, self.names.module(module),
            cause="DeepSpeed's fetch queue disagreed with the module's parameters: "
                  + str(error).splitlines()[0]))

    # -- registration notes ---------------------------------------------------------------
    def note_read_step(self, running: nn.Module, param: nn.Parameter) -> None:
        seen = self.read_steps.setdefault((id(running), id(param)), [0, self.step, -1])
        if seen[2] != self.step:
            seen[0] += 1
            seen[2] = self.step

    def module_counts(self) -> dict[str, int]:
        """How often each module appears in a recorded trace (forward + backward; 2 is once per step)."""
        counts: dict[str, int] = {}
        for trace in self.cache.traces():
            for m, n in Counter(trace.modules).items():
                path = self.names.module(m)
                counts[path] = max(counts.get(path, 0), n)
        return counts

    def read_pattern(self) -> dict[tuple[str, str], dict[str, int]]:
        """Per cross-module read: on how many of the steps with a forward it happened."""
        modules = {id(m): m for m in self.engine.module.modules()}
        params = {id(p): p for p in self.engine.module.parameters()}
        return {(self.names.module(modules[m]), self.names.param(params[p])):
                {"steps": n, "first": first, "last": last}
                for (m, p), (n, first, last) in self.read_steps.items() if m in modules and p in params}

    def note_read(self, running: nn.Module, param: nn.Parameter, source: str | None) -> None:
        self.diagnostics.reads.append(CrossModuleRead(
            self.names.module(running), self.names.param(param), bool(getattr(param, "ds_persist", False)),
            self.step, source))
