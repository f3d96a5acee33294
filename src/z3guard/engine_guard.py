"""EngineGuard: everything z3guard attaches to one DeepSpeed engine."""
from __future__ import annotations

import logging
from typing import Any

from .adapter.base import Adapter
from .checkpoint.engine import CheckpointGuard
from .diagnose import Diagnostics, Divergence, Names
from .options import GuardOptions
from .trace import TraceGuard

log = logging.getLogger("z3guard")


class EngineGuard:
    def __init__(self, engine: Any, adapter: Adapter, options: GuardOptions):
        self.engine = engine
        self.adapter = adapter
        self.options = options
        self.names = Names(engine.module)
        rank0 = _rank() == 0
        self.diagnostics = Diagnostics(warn=options.warn and rank0)
        self.trace = TraceGuard(engine, adapter, self.names, self.diagnostics)
        adapter.guard_coordinator(engine, self.trace)
        self.checkpoint = CheckpointGuard(engine, adapter)
        self.fast_paths = adapter.apply_fast_paths(engine, options)
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
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
