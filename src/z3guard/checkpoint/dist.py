"""The few collectives the checkpoint code needs; all degrade to one process without a group."""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def barrier() -> None:
    if active():
        dist.barrier()


def gather_all(obj: Any) -> list[Any]:
    """Every rank's `obj`, on every rank (so that all ranks take the same decision)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def raise_if_any(problem: str | None, error: type[Exception]) -> None:
    """Raise `error` on every rank when any rank found a problem: no rank is left in a collective."""
    problems = [p for p in gather_all(problem) if p]
    if problems:
        raise error(problems[0])


def on_every_rank(action: Callable[[], Any], error: type[Exception]) -> list[Any]:
    """This rank's `action()`, then every rank's results on every rank (one collective); a failure on any
    rank raises `error` on all, so none is left waiting in a collective for one that raised."""
    result, problem = None, None
    try:
        result = action()
    except Exception as exc:  # torch.save reports a failed write as RuntimeError, not OSError
        problem = f"rank {rank()}: {exc}"
    parts = gather_all((result, problem))
    problems = [p for _, p in parts if p]
    if problems:
        raise error(problems[0])
    return [r for r, _ in parts]
