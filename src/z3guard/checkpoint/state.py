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
    elif state.get("cuda_seed") is not None and torch.cuda.is_available():
        torch.cuda.manual_seed(state["cuda_seed"])


def path(folder: Path, rank: int | None = None) -> Path:
    return folder / STATE.format(rank=dist.rank() if rank is None else rank)


def save(folder: Path, state: dict[str, Any]) -> None:
    torch.save(state, path(folder))


def load(folder: Path, saved_world: int | None = None) -> dict[str, Any] | None:
    """This rank's saved state. From a checkpoint saved on `saved_world` other ranks: rank r takes saved
    rank r's streams, and a rank r >= saved_world those of saved rank r mod saved_world, each generator
    then re-seeded from one draw of its own and r (distinct, and the same on every resume)."""
    r = dist.rank()
    source = r if saved_world is None else r % saved_world
    p = path(folder, source)
    # Our own file (RNG tuples and numpy arrays), verified by the manifest before this point.
    state = torch.load(p, weights_only=False) if p.exists() else None
    if state is not None and source != r:
        state = _derived(state, r)
    return state


def _derived(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """`state`'s streams, each re-seeded from its next draw and `rank`; CUDA's from torch's new seed + 1."""
    py, npr, gen = random.Random(), np.random.RandomState(), torch.Generator()
    py.setstate(state["python_rng"])
    npr.set_state(state["numpy_rng"])
    gen.set_state(state["torch_rng"])
    py.seed(f"{py.getrandbits(64)}:{rank}", version=2)
    npr.seed([int(npr.randint(2**31)), rank])
    seed = int(torch.randint(2**62, (1,), generator=gen)) + rank
    gen.manual_seed(seed)
    return {**state, "python_rng": py.getstate(), "numpy_rng": npr.get_state(), "torch_rng": gen.get_state(),
            "cuda_rng": None, "cuda_seed": seed + 1 if state.get("cuda_rng") is not None else None}
