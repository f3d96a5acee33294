"""No ZeRO-3 hooks on modules that hold no parameters: activations, dropout, pooling.

ZeRO-3 registers four hooks on every module: before and after its forward (fetch and release its
parameters, record the module in the trace, prefetch what comes next) and, through two autograd functions
wrapped around its inputs and outputs, before and after its backward. Without offload the step waits on the
host running these hooks: a GPT-2 block has thirteen modules, four of them (an activation and three dropouts)
with no parameter below them. For such a module every hook fetches and releases nothing; all they change is
bookkeeping (the trace, the prefetch cursor) and two identity functions in the autograd graph.

So the hooks come off the modules whose whole subtree holds no parameter and no external parameter, right
after DeepSpeed registered them. The kernels, the gathers' and reduce-scatters' contents and order, and the
gradients are the same: every parameter is fetched by the module that holds it, and the autograd functions
removed pass their tensors through. What moves is when a prefetch is issued (at the next module that has
parameters, not at the parameterless one in between), which changes no bytes. Nothing is removed where the
trace could need the module: a module the user gave an external parameter keeps its hooks.
"""
from __future__ import annotations

from typing import Any

from torch import nn

MARK = "_z3guard_quiet"  # on the modules whose hooks came off: what `quieted` counts
HOOKS_PER_SIDE = 2  # before the forward: fetch, and the post-backward wrapper; after it: release, pre-backward


def quiet(offload: Any, root: nn.Module) -> int:
    """Remove ZeRO-3's hooks, as registered by `offload` (a DeepSpeedZeRoOffload), from `root`'s modules
    that hold no parameter below them; returns how many modules lost theirs. A module keeps all four hooks
    or loses all four: one without the other would unbalance DeepSpeed's stack of running modules."""
    empty = [m for m in _parameterless(root) if m is not root]
    handles: dict[int, list[Any]] = {}
    for handle in [*offload.forward_hooks, *offload.backward_hooks]:  # DeepSpeed's own, nothing else
        handles.setdefault(id(handle.hooks_dict_ref()), []).append(handle)
    done = 0
    for m in empty:
        pre, post = handles.get(id(m._forward_pre_hooks), []), handles.get(id(m._forward_hooks), [])
        if len(pre) != HOOKS_PER_SIDE or len(post) != HOOKS_PER_SIDE:
            continue
        for handle in pre + post:
            handle.remove()  # DeepSpeed's own removal of its hooks later finds nothing left to remove
        setattr(m, MARK, True)
        done += 1
    return done


def quieted(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if getattr(m, MARK, False))


def _parameterless(module: nn.Module) -> list[nn.Module]:
    """The modules under `module` (itself included) whose subtree holds no parameter and no external one."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> bool:
        empty = [visit(child) for child in m.children()]
        own = next(m.parameters(recurse=False), None) is None and not getattr(m, "_external_params", None)
        if own and all(empty):
            found.append(m)
            return True
        return False

    visit(module)
    return found
