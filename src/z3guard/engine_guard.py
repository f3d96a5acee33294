"""EngineGuard: everything z3guard attaches to one DeepSpeed engine."""
from __future__ import annotations

import logging
from typing import Any, Callable

from .adapter.base import Adapter
from .checkpoint.engine import CheckpointGuard
from .diagnose import Diagnostics, Divergence, Names
from .options import GuardOptions
from .trace import TraceGuard

log = logging.getLogger("z3guard")


class EngineGuard:
    """The trace guard, the checkpoint guard and the fast paths of one engine; all or none are applied."""

    def __init__(self, engine: Any, adapter: Adapter, options: GuardOptions):
        self.engine = engine
        self.adapter = adapter
        self.options = options
        self.names = Names(engine.module)
        rank0 = _rank() == 0
        self.diagnostics = Diagnostics(warn=options.warn and rank0)
        undo: list[Callable[[], None]] = []
        try:  # a failure part-way undoes what was applied: never a half-guarded engine
            self.trace = TraceGuard(engine, adapter, self.names, self.diagnostics)
            undo.append(self.trace.remove)
            adapter.guard_coordinator(engine, self.trace)
            undo.append(lambda: adapter.unguard_coordinator(engine))
            self.checkpoint = CheckpointGuard(engine, adapter)
            undo.append(self.checkpoint.remove)
            self.fast_paths = adapter.apply_fast_paths(engine, options)
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        if rank0 and self.fast_paths:
            log.info("z3guard: offload fast paths on: %s", ", ".join(self.fast_paths))

    def remove(self) -> None:
        self.adapter.unguard_coordinator(self.engine)
        self.trace.remove()
        self.checkpoint.remove()
        self.adapter.remove_fast_paths(self.engine)

    @property
    def divergences(self) -> list[Divergence]:
        return list(self.diagnostics.divergences)

    def summary(self) -> str:
        return self.diagnostics.summary()


def _rank() -> int:
    from .checkpoint import dist

    return dist.rank()
