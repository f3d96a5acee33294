"""Bit-for-bit comparison of two runs: losses by step, and gathered tensors by name."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Difference:
    where: str  # "loss@7" or a tensor name
    detail: str

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}"


def first_loss_difference(reference: dict[str, float], other: dict[str, float],
                          label: str = "loss") -> Difference | None:
    for step in sorted(other, key=int):
        if step not in reference:
            return Difference(f"{label}@{step}", "step missing from the reference run")
        a, b = reference[step], other[step]
        if a != b and not (math.isnan(a) and math.isnan(b)):
            return Difference(f"{label}@{step}", f"{b!r} != reference {a!r} (abs diff {abs(a - b):.3e})")
    return None


def first_tensor_difference(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> Difference | None:
    for name in sorted(set(reference) | set(other)):
        if name not in reference or name not in other:
            return Difference(name, "present in only one run")
        a, b = reference[name], other[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return Difference(name, f"shape/dtype {tuple(b.shape)}/{b.dtype} != {tuple(a.shape)}/{a.dtype}")
        if not _same(a, b, nan_is_nan=name.startswith("grad/")):
            diff = (a.double() - b.double()).abs().max().item()
            return Difference(name, f"max abs diff {diff:.3e}")
    return None


def _same(a: torch.Tensor, b: torch.Tensor, nan_is_nan: bool) -> bool:
    """Equal values; with `nan_is_nan` (gradients, which a skipped step leaves non-finite) NaN where NaN,
    whatever the payload bits (a cast on the host gives other payloads than one on the GPU)."""
    if torch.equal(a, b) or _bits(a).equal(_bits(b)):  # the same bits, NaNs included
        return True
    return nan_is_nan and a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def first_job_difference(done: Any, reference: str, other: str, nproc: int = 2) -> Difference | None:
    """Two jobs of one launch: losses and gradient norms, gathered weights, then each rank's optimizer
    partition."""
    for key, label in (("losses", "loss"), ("grad_norms", "grad_norm")):  # norms: where the job kept them
        if d := first_loss_difference(done.result(reference).get(key, {}), done.result(other).get(key, {}), label):
            return d
    if d := first_tensor_difference(done.state(reference), done.state(other)):
        return d
    for rank in range(nproc):
        if d := first_tensor_difference(done.optimizer(reference, rank), done.optimizer(other, rank)):
            return Difference(f"rank {rank}: {d.where}", d.detail)
    return None
