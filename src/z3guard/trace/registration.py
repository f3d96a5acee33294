"""Where a parameter read becomes a registration.

Stock ZeRO-3 registers a parameter that a module's forward reads from another module only if the
parameter happens to be partitioned at that moment, so the recorded trace depends on what was
gathered when it was recorded (after a resume, persistent biases are gathered and never make it in).
Here the read is registered whatever the parameter's state, so that the trace depends on the code path
alone; and on every rank at once, at the next step boundary (agreement.py): a read that happens on one
rank only must not change that rank's gathers alone.
"""
from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .guard import TraceGuard

# Every module of a guarded engine -> that engine's TraceGuard. Unguarded modules are left alone.
GUARDS: "weakref.WeakKeyDictionary[nn.Module, TraceGuard]" = weakref.WeakKeyDictionary()


def on_read(running: nn.Module, param: nn.Parameter, in_engine_forward: bool = True,
            owner: nn.Module | None = None, raw: bool = False) -> bool:
    """Called by the adapter when `running`'s forward reads a parameter of another module, `owner`. The read
    gets a filled tensor: one in flight is waited for; a partitioned one is gathered on every rank or none
    (lockstep.py), by stock's getter inside engine.forward and here outside it, where stock hands out
    the empty partition (generate() on the module, a checkpointed forward's recompute). Left alone: a read
    across two models, and any read while the model's hooks are removed (generate() inside
    unwrap_model_for_generation, where every weight is gathered; DeepSpeed's stack of running modules then
    holds what it last pushed, and a checkpoint recompute that stopped early leaves entries there too).
    Returns whether the read was taken (the parameter is then filled and the coordinator's to release).

    `raw`: a read through parameters(), named_parameters() or state_dict() of a parameter in flight. It is
    waited for and left unregistered: such reads are mostly of metadata (transformers' `self.dtype` takes
    `next(self.parameters())`), and registering them would keep those weights gathered. A partitioned one
    keeps stock's empty partition, which fails loudly where it is computed on."""
    guard = GUARDS.get(running)
    if guard is None or (owner is not None and GUARDS.get(owner) is not guard):
        return False
    if not guard.adapter.hooks_installed(guard.engine):
        return False
    if raw:
        guard.adapter.wait_if_inflight(guard.engine, param)
        return True
    guard.note_read_step(running, param)
    guard.adapter.wait_if_inflight(guard.engine, param)
    if guard.adapter.owns(running, param):
        return True
    if not guard.adapter.is_gathered(param):
        guard.before_first_read(running, param)
        if not in_engine_forward:
            guard.adapter.fetch_read(running, param)
    guard.defer_read(running, param, _user_frame())
    return True


def _user_frame() -> str | None:
    """The first caller outside torch, DeepSpeed and z3guard: where the user's model read it."""
    frame = sys._getframe(2)
    skip = ("/torch/", "/deepspeed/", "/z3guard/adapter/", "/z3guard/trace/")
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(s in name for s in skip):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None
