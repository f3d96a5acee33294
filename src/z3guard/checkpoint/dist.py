"""The few collectives the checkpoint code needs; all degrade to one process without a group."""
from __future__ import annotations

from typing import Any

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
