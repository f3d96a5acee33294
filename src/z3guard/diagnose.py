"""Divergence records, told in the names a user knows: module paths and parameter names."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

log = logging.getLogger("z3guard")


class RankDivergenceError(RuntimeError):
    """The ranks ran different modules (or read different parameters across modules) on one step: ZeRO-3
    cannot go on. Raised on every rank, with one message naming the module (see trace/lockstep.py)."""


@dataclass(frozen=True)
class Divergence:
    """One departure of a running step from the recorded ZeRO-3 trace."""

    kind: str  # "param-set" | "order" | "tracing-error" | "renumbered"
    step: int  # the training step in progress (1-based, as DeepSpeed counts global steps + 1)
    module: str  # path in the model, e.g. "visual.attnpool"
    added: tuple[str, ...] = ()  # parameters the module needs now that the trace lacked
    removed: tuple[str, ...] = ()  # parameters the trace holds that the module no longer needs
    expected: str | None = None  # for "order": the module the trace expected at this position
    cause: str = ""
    fix: str = ""

    def key(self) -> tuple:
        return (self.kind, self.module, self.added, self.removed, self.expected)

    def message(self) -> str:
        what = {
            "param-set": f"module '{self.module}' needs a different parameter set than its recorded trace",
            "order": f"module '{self.module}' ran where the trace expected '{self.expected}'",
            "tracing-error": f"DeepSpeed's fetch queue disagreed with module '{self.module}'",
            "renumbered": "the model's ZeRO-3 hooks were registered again while a trace was being recorded",
        }[self.kind]
        parts = [f"z3guard: step {self.step}: {what}"]
        if self.added:
            parts.append(f"  not in trace: {', '.join(self.added)}")
        if self.removed:
            parts.append(f"  no longer used: {', '.join(self.removed)}")
        parts.append(f"  cause: {self.cause}")
        parts.append("  recovered: trace invalidated, parameters fetched on demand, a new trace is recorded")
        if self.fix:
            parts.append(f"  to remove it without z3guard: {self.fix}")
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CrossModuleRead:
    """A forward of `module` read `param`, which another module owns; z3guard registered it."""

    module: str
    param: str
    persistent: bool
    step: int
    source: str | None  # "file:line" of the read in user code, where found


class Names:
    """Module paths and parameter names of one model, looked up by object."""

    def __init__(self, model: nn.Module):
        self._modules = {id(m): name or "<root>" for name, m in model.named_modules(remove_duplicate=False)}
        self._params: dict[int, str] = {}
        # The first name wins for a shared (tied) parameter, as state_dict keys do.
        for name, p in reversed(list(model.named_parameters(remove_duplicate=False))):
            self._params[id(p)] = name

    def module(self, m: nn.Module | None) -> str:
        return "<end of trace>" if m is None else self._modules.get(id(m), type(m).__name__)

    def param(self, p: nn.Parameter) -> str:
        return self._params.get(id(p), f"<unnamed {tuple(p.ds_shape) if hasattr(p, 'ds_shape') else ''}>")

    @staticmethod
    def attr_path(path: str) -> str:
        """`visual.attnpool` -> `model.visual.attnpool`, `blocks.0.fc1` -> `model.blocks[0].fc1`."""
        if path == "<root>":
            return "model"
        return "model" + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in path.split("."))


@dataclass
class Diagnostics:
    """All records of one engine; warns once per distinct divergence. Memory stays bounded over a run of
    any length: the first KEPT records are kept whole, every divergence is counted by its key."""

    KEPT = 1000

    warn: bool = True
    divergences: list[Divergence] = field(default_factory=list)
    reads: list[CrossModuleRead] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # key -> how many times

    def add(self, d: Divergence) -> None:
        if len(self.divergences) < self.KEPT:
            self.divergences.append(d)
        first = d.key() not in self.counts
        self.counts[d.key()] += 1
        if first and self.warn:
            log.warning(d.message())

    def summary(self) -> str:
        if not self.counts and not self.reads:
            return "z3guard: no trace divergences, no cross-module parameter reads"
        lines = [f"z3guard summary: {sum(self.counts.values())} trace divergence(s) "
                 f"({len(self.counts)} distinct), {len(self.reads)} cross-module read(s) registered"]
        for key in sorted(self.counts, key=str):
            lines.append(f"  {key[0]:<13} {key[1]}: {self.counts[key]}x")
        for r in self.reads:
            lines.append(f"  read          {r.module} reads {r.param}{' (persistent)' if r.persistent else ''}"
                         f"{' at ' + r.source if r.source else ''}")
        return "\n".join(lines)
