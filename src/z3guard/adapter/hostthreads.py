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
    per_rank = usable_cpus() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return per_rank if per_rank > 1 else 0


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process may use: its affinity mask, capped by its container's CPU quota (cgroup v2
    `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, the tightest along the path). A pod limited to
    4 CPUs on a 64-core host sees 64 in its affinity mask; 16 threads per rank there were measured 11 x
    slower than a share of the quota. Whole CPUs, rounded down, at least one."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_quota(cgroup_root, membership)
    return max(1, min(cpus, int(quota))) if quota is not None else cpus


def _cgroup_quota(root: Path, membership: Path) -> float | None:
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: one unified tree
            limits += _along(root, path, lambda d: _v2_limit(d / "cpu.max"))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's tree
            base = root / controllers
            if not base.is_dir():
                base = next((d for d in root.glob("cpu*") if "cpu" in d.name.split(",")), base)
            limits += _along(base, path, _v1_limit)
    return min(limits) if limits else None


def _along(base: Path, path: str, read) -> list[float]:
    """The limit of the cgroup and of each ancestor that is visible (a container sees its own as "/")."""
    parts = [p for p in path.strip("/").split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        limit = read(base.joinpath(*parts[:depth]))
        if limit is not None:
            found.append(limit)
    return found


def _v2_limit(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
