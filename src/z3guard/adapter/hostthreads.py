"""How many OpenMP threads the host-side optimizer step may use, and who chose the current count.

torchrun sets OMP_NUM_THREADS=1 for every rank unless the user set it, so with `offload_optimizer` the
whole CPU optimizer step runs on one core per rank. z3guard raises the count for that step only when
torchrun, not the user, chose 1 (see fastpaths.py for why the results stay bit-identical).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch


def launcher_left_one_thread(environ: Mapping[str, str], launcher_environ: Mapping[str, str] | None) -> bool:
    """True when torchrun, not the user, set OMP_NUM_THREADS=1: a user's value is in torchrun's own
    starting environment too (`launcher_environ`, read from /proc, which later changes do not reach)."""
    return (environ.get("OMP_NUM_THREADS") == "1" and "TORCHELASTIC_RUN_ID" in environ
            and launcher_environ is not None and "OMP_NUM_THREADS" not in launcher_environ)


def _launcher_environ() -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)


def host_threads(requested: int | None) -> int:
    """OpenMP threads for the host-side optimizer step; 0 leaves the count alone. `None` (auto) acts
    only on torchrun's default of one thread per rank, never on a count the user chose."""
    if requested is not None:
        return max(0, requested)
    if not launcher_left_one_thread(os.environ, _launcher_environ()) or torch.get_num_threads() != 1:
        return 0
    per_rank = len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return per_rank if per_rank > 1 else 0
