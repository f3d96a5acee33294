"""2 MiB pages under the host optimizer state (`offload_optimizer`).

The host step streams the fp32 partition and both Adam moments (GPT-2 medium: 3 x 710 MB per rank) through
memory once per step; on 4 KiB pages that is a TLB miss every 4 KiB of every stream. PyTorch's CPU
allocator asks for 2 MiB pages only when THP_MEM_ALLOC_ENABLE=1 was set before it started, and the kernel
then backs them at first touch; DeepSpeed has touched these tensors by the time z3guard sees the engine.
`madvise(MADV_COLLAPSE)` (Linux 6.1) moves memory already in use onto 2 MiB pages in place: same
addresses, same bytes, so every result stays bit-identical. Pinned buffers cannot move and are left alone;
where the kernel cannot collapse, nothing changes.
"""
from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Any, Iterable

import torch

log = logging.getLogger("z3guard")
HUGE = 1 << 21
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def collapse(t: torch.Tensor) -> int:
    """Bytes of `t`'s storage now on 2 MiB pages (the whole 2 MiB-aligned part of it, or 0 where the
    kernel refused)."""
    storage = t.untyped_storage()
    base = storage.data_ptr()
    start, end = (base + HUGE - 1) & ~(HUGE - 1), (base + storage.nbytes()) & ~(HUGE - 1)
    if t.device.type != "cpu" or end <= start or t.is_pinned():
        return 0
    _libc.madvise(start, end - start, MADV_HUGEPAGE)  # keeps khugepaged from splitting them again
    return end - start if _libc.madvise(start, end - start, MADV_COLLAPSE) == 0 else 0


def host_state(opt: Any) -> Iterable[torch.Tensor]:
    """The host optimizer state the step streams: each host sub-group's fp32 partition and its optimizer
    state tensors."""
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        if fp32 is None or fp32.device.type != "cpu" or fp32.numel() == 0:
            continue
        yield fp32
        yield from (v for v in opt.optimizer.state.get(fp32, {}).values() if torch.is_tensor(v) and v.dim())


def refresh(opt: Any) -> None:
    """Collapse what is new since the last call (the state appears at the first step, a checkpoint's load
    replaces it): each tensor is tried once for the memory it holds."""
    seen = opt.__dict__.setdefault("z3guard_huge_seen", {})  # id -> (weak reference, data_ptr)
    for t in host_state(opt):
        ref, ptr = seen.get(id(t), (None, None))
        if ref is None or ref() is not t or ptr != t.data_ptr():
            collapse(t)
            seen[id(t)] = (weakref.ref(t), t.data_ptr())
