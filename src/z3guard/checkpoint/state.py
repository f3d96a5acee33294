"""What exact resume needs beyond DeepSpeed's own files: RNG streams, loss scaler, data position."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import dist

STATE = "z3guard_state_rank{rank}.pt"


def capture(loss_scaler: dict[str, Any], data_position: Any = None) -> dict[str, Any]:
    state = {
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "torch_rng": torch.get_rng_state(),
        # this rank's device only (a resume may see another number of GPUs: SLURM, one per task), and only
        # where this process uses CUDA (a CPU run on a GPU host leaves it alone)
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        "loss_scaler": loss_scaler,
        "data_position": data_position,
    }
    return state


def restore(state: dict[str, Any]) -> None:
    random.setstate(state["python_rng"])
    np.random.set_state(state["numpy_rng"])
    torch.set_rng_state(state["torch_rng"])
    cuda = state.get("cuda_rng")
    if isinstance(cuda, (list, tuple)):  # every visible device's, as checkpoints before 2026-11-30 hold them
        cuda = cuda[torch.cuda.current_device()] if torch.cuda.is_available() and \
            torch.cuda.current_device() < len(cuda) else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def path(folder: Path, rank: int | None = None) -> Path:
    return folder / STATE.format(rank=dist.rank() if rank is None else rank)


def save(folder: Path, state: dict[str, Any]) -> None:
    torch.save(state, path(folder))


def load(folder: Path) -> dict[str, Any] | None:
    p = path(folder)
    # Our own file (RNG tuples and numpy arrays), verified by the manifest before this point.
    return torch.load(p, weights_only=False) if p.exists() else None
