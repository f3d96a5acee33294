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
            self.trace = TraceGuard(engine, adapter, self.names, self.diagnostics, options.lockstep_timeout)
            undo.append(self.trace.remove)
            adapter.guard_coordinator(engine, self.trace, multi_trace=options.fast_paths)
            undo.append(lambda: adapter.unguard_coordinator(engine))
            self.checkpoint = CheckpointGuard(engine, adapter, durable=options.durable_saves)
            undo.append(self.checkpoint.remove)
            self.fast_paths = adapter.apply_fast_paths(engine, options)
        except BaseException:
            for step in reversed(undo):
                step()
            raise
        if rank0:
            try:  # the engine is guarded by now: a line that cannot be made must not undo or break that
                log.warning(self.banner())
            except Exception as exc:
                log.warning("z3guard guards this ZeRO-3 engine (its summary line failed: %s)", exc)

    def banner(self) -> str:
        """The one line rank 0 logs when the engine is guarded: what z3guard does to it, how to stop it."""
        from . import __version__
        from .adapter import installed_release

        coordinators = self.adapter.coordinators(self.engine)
        paths = (["multi_trace"] if any(getattr(c, "multi_trace", False) for c in coordinators) else [])
        paths += self.fast_paths
        return (f"z3guard {__version__} guards this ZeRO-3 engine (DeepSpeed {installed_release()}): trace guard, "
                f"checkpoint guard; speed paths: {', '.join(paths) if paths else 'none'}. Speed paths off: "
                "Z3GUARD_OPTIONS=fast_paths=off or GuardOptions(fast_paths=False); z3guard off: Z3GUARD=0 or "
                "no z3guard.install()")

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
