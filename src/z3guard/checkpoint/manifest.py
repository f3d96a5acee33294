"""The manifest: every file of a checkpoint with its size and sha256, and what wrote it."""
from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import digest, dist
from .errors import CheckpointError

MANIFEST = "z3guard-manifest.json"


@dataclass
class Manifest:
    tag: str
    world_size: int
    zero_stage: int
    dtype: str
    global_step: int
    deepspeed: str
    torch: str
    z3guard: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # relpath -> {size, sha256_blocks}
    # node-local saves: each node's disk holds its own ranks' files and a manifest of those
    storage: int = 0
    storages: int = 1

    def write(self, folder: Path, sync: bool = True) -> None:
        write_durably(folder / MANIFEST, json.dumps(asdict(self), indent=1, sort_keys=True).encode(), sync)

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        path = folder / MANIFEST
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{path}: unreadable manifest ({exc}); the checkpoint cannot be verified. "
                                  "Load an older checkpoint, or delete the manifest to load it unverified.") from exc


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def owner(name: str, index: int, members: list[int]) -> int:
    """The rank among `members` (those that see the folder) that checks file `name`: the rank whose state it
    holds (the number after "rank" in DeepSpeed's and z3guard's file names), so that each rank reads what it
    is about to load; unnumbered files by position."""
    found = _RANK.search(name)
    return members[(int(found.group(1)) if found else index) % len(members)]


_RANK = re.compile(r"rank_?(\d+)")


def verify(folder: Path, world_size: int | None = None, zero_stage: int | None = None,
           dtype: str | None = None) -> Manifest:
    """Check a checkpoint folder against its manifest; raise CheckpointError (on every rank) on the first
    problem. Sizes and fields are checked by every rank; the content hashes by the ranks that see this
    folder, each its own files, each file's blocks on several threads."""
    folder = Path(folder)
    m, problem = None, None
    try:
        m = _checked(folder, world_size, zero_stage, dtype)
    except (CheckpointError, OSError) as exc:  # a file removed while it was checked
        problem = str(exc)
    views = dist.gather_all((problem, m.storage if m else None))
    problems = [p for p, _ in views if p]
    if problems:
        raise CheckpointError(problems[0])
    assert m is not None
    members = [r for r, (_, storage) in enumerate(views) if storage == m.storage]
    names = sorted(m.files)
    mine = [n for i, n in enumerate(names) if owner(n, i, members) == dist.rank()]
    problem = None
    try:
        with ThreadPoolExecutor(digest.threads()) as pool:
            for n in mine:
                why = digest.mismatch(folder / n, m.files[n], pool)
                if why:
                    problem = f"{folder / n}: {why} (corrupted); load an older checkpoint."
                    break
    except (OSError, KeyError, TypeError) as exc:  # unreadable, or a manifest entry without hashes
        problem = f"{folder}: cannot verify it: {exc!r}"
    dist.raise_if_any(problem, CheckpointError)
    return m


def _checked(folder: Path, world_size: int | None, zero_stage: int | None, dtype: str | None) -> Manifest:
    """The manifest, its fields against this job's, and every listed file's presence and size."""
    if not (folder / MANIFEST).exists():
        raise CheckpointError(f"{folder / MANIFEST}: missing, so {folder} cannot be verified (written without "
                              "z3guard, or not by a save that finished)")
    m = Manifest.read(folder)
    for name, want, got in (("world_size", world_size, m.world_size), ("zero_stage", zero_stage, m.zero_stage),
                            ("dtype", dtype, m.dtype)):
        if want is not None and want != got:
            hint = {"world_size": "ZeRO-3 partitions are per rank: convert it with DeepSpeed's universal "
                                  "checkpoint (python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                                  f"{folder} --output_folder OUT) and load with \"checkpoint\": "
                                  "{\"load_universal\": true}, or run with the original world size",
                    "zero_stage": "load it with the ZeRO stage it was written with",
                    "dtype": "load it with the precision it was written with (fp16/bf16/fp32 in the config)"}[name]
            raise CheckpointError(f"{folder / MANIFEST}: field '{name}' is {got!r}, this job expects {want!r}; {hint}")
    missing = [n for n in m.files if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"{folder / missing[0]}: missing (listed in the manifest with "
                              f"{m.files[missing[0]]['size']} bytes); {len(missing)} file(s) missing in all. "
                              "The checkpoint is incomplete: load an older one.")
    sizes = {n: (folder / n).stat().st_size for n in m.files}
    for n, size in sizes.items():
        if size != m.files[n]["size"]:
            raise CheckpointError(f"{folder / n}: {size} bytes, the manifest says {m.files[n]['size']} "
                                  "(truncated or overwritten); load an older checkpoint.")
    return m


def write_durably(path: Path, data: bytes, sync: bool = True) -> None:
    """Write via a temporary file, then rename over `path`: readers see old or new, never half. With
    `sync`, the file and then the rename are on disk when this returns."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        fsync_dir(path.parent)


def fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*"), reverse=True):
        if p.is_file():
            fsync_file(p)
        else:
            fsync_dir(p)
    fsync_dir(folder)


def fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
