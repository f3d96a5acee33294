"""z3guard: keep DeepSpeed ZeRO-3 training alive through resume, skipped steps and trace divergences.

    import z3guard; z3guard.install()   # before the engine is created (Trainer, accelerate included)
    z3guard.guard(engine)                # or: guard an engine that already exists
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any

from .diagnose import Divergence, RankDivergenceError
from .options import GuardOptions

if TYPE_CHECKING:
    from .engine_guard import EngineGuard

__version__ = "0.1.0"
__all__ = ["install", "uninstall", "guard", "report", "summary", "set_data_position", "resumed_state",
           "GuardOptions", "Divergence", "RankDivergenceError"]

log = logging.getLogger("z3guard")
_GUARDED: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_state: dict[str, Any] = {"installed": False, "patched": False, "options": GuardOptions()}


def install(options: GuardOptions | None = None) -> bool:
    """Guard every ZeRO-3 engine created from now on; returns whether it did. Idempotent.

    On a DeepSpeed whose internals fail z3guard's self-check, nothing is patched and one warning says why
    (`GuardOptions(strict=True)` raises instead): z3guard never breaks a job it cannot guard."""
    from . import adapter
    from .adapter.releases import tested
    from .trace import on_read

    if options is not None:
        _state["options"] = options
    if _state["installed"]:
        return True
    try:
        ad = adapter.load()
        ad.patch_globals(on_read, _on_engine, _build_options)
    except Exception as exc:
        _unpatch_quietly()
        if _state["options"].strict:
            raise
        _warn_once(f"z3guard: not guarding this job, DeepSpeed runs as it would without z3guard: {exc}")
        return False
    if tested(adapter.installed_release()) is None:
        _warn_once(f"z3guard: DeepSpeed {adapter.installed_release()} is not among the releases z3guard was tested "
                   "on; its internals passed z3guard's self-check, so the crash fix is on (speed paths follow "
                   "their own checks). Please report problems with `z3guard env`'s output.")
    _state["installed"] = _state["patched"] = True
    return True


def _unpatch_quietly() -> None:
    from . import adapter

    try:
        adapter.load().unpatch_globals()
    except Exception:  # nothing was patched: load itself failed
        pass


@functools.cache
def _warn_once(message: str) -> None:
    if _rank() == 0:
        log.warning(message)


def _rank() -> int:
    from .checkpoint import dist

    return dist.rank() if dist.active() else int(os.environ.get("RANK", "0"))


def uninstall() -> None:
    """Undo `install()` and unguard every engine; a no-op when nothing was installed."""
    from . import adapter

    for g in list(_GUARDED.values()):
        g.remove()
    _GUARDED.clear()
    if _state["patched"]:
        adapter.load().unpatch_globals()
    _state["installed"] = _state["patched"] = False
    _state["options"] = GuardOptions()


def guard(engine: Any, options: GuardOptions | None = None) -> "EngineGuard | None":
    """Guard an existing engine; returns its EngineGuard, or None where it is not ZeRO-3 or cannot be
    guarded (then it runs as stock, after one warning; `strict=True` raises instead). Idempotent."""
    from . import adapter
    from .engine_guard import EngineGuard
    from .trace import on_read

    if engine in _GUARDED:
        return _GUARDED[engine]
    options = options or _state["options"]
    try:
        ad = adapter.load()
        if not ad.is_zero3(engine):
            log.info("z3guard: engine is not ZeRO stage 3; nothing to guard")
            return None
        ad.patch_globals(on_read, _on_engine, _build_options)  # reads must be seen even without install()
        _state["patched"] = True
        g = EngineGuard(engine, ad, options)  # all or nothing: a failure part-way undoes what it applied
    except Exception as exc:
        if options.strict:
            raise
        _warn_once(f"z3guard: this engine is not guarded, DeepSpeed runs it as it would without z3guard: "
                   f"{type(exc).__name__}: {exc}")
        return None
    _GUARDED[engine] = g
    return g


def _build_options() -> GuardOptions | None:
    """Asked as an engine is built: the speed paths that act on a model before DeepSpeed's hooks are
    registered (or right after) act only on the engines install() guards."""
    return _state["options"] if _state["installed"] else None


def _on_engine(engine: Any) -> None:
    if _state["installed"]:
        guard(engine)


def report(engine: Any) -> list[Divergence]:
    """Every trace divergence recorded for `engine` (empty if unguarded or none happened)."""
    g = _GUARDED.get(engine)
    return g.divergences if g is not None else []


def summary(engine: Any) -> str:
    """A readable account of the engine's trace divergences (what `report` returns, as text)."""
    g = _GUARDED.get(engine)
    return g.summary() if g is not None else "z3guard: engine not guarded"


def set_data_position(engine: Any, position: Any) -> None:
    """Where the data loader stands (any picklable object); saved per rank with the next checkpoint."""
    g = guard(engine)
    if g is None:
        raise ValueError("z3guard.set_data_position: this engine is not ZeRO stage 3, so z3guard does not save its "
                         "checkpoints; set \"zero_optimization\": {\"stage\": 3} or keep the position yourself.")
    g.checkpoint.data_position = position


def resumed_state(engine: Any) -> dict[str, Any] | None:
    """After `load_checkpoint`: the extra state z3guard saved (RNG, loss scaler, data position); from a
    checkpoint saved on another number of ranks also `saved_world_size` and `saved_rank` (whose state
    this rank took), to derive a per-rank data position from."""
    g = _GUARDED.get(engine)
    return g.checkpoint.resumed_state if g is not None else None


@atexit.register
def _summarise() -> None:
    for g in list(_GUARDED.values()):
        if g.diagnostics.warn and g.diagnostics.divergences:
            log.warning(g.summary())
