"""The manifest: every file of a checkpoint with its size and sha256, and what wrote it."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import dist
from .errors import CheckpointError

MANIFEST = "z3guard-manifest.json"
CHUNK = 1 << 22


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
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # relpath -> {size, sha256}

    def write(self, folder: Path) -> None:
        write_durably(folder / MANIFEST, json.dumps(asdict(self), indent=1, sort_keys=True).encode())

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        path = folder / MANIFEST
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{path}: unreadable manifest ({exc}); the checkpoint cannot be verified. "
                                  "Load an older checkpoint, or delete the manifest to load it unverified.") from exc


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def hash_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Hash `names` with the work split across ranks (each hashes every world-th file)."""
    def mine() -> dict[str, dict[str, Any]]:
        return {n: {"size": (folder / n).stat().st_size, "sha256": sha256(folder / n)}
                for i, n in enumerate(names) if i % dist.world() == dist.rank()}

    merged: dict[str, dict[str, Any]] = {}
    for part in dist.on_every_rank(mine, CheckpointError):
        merged.update(part)
    return merged


def verify(folder: Path, world_size: int | None = None, zero_stage: int | None = None,
           dtype: str | None = None) -> Manifest:
    """Check a checkpoint folder against its manifest; raise CheckpointError on the first problem."""
    folder = Path(folder)
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
    hashes = hash_files(folder, sorted(m.files))
    for n in sorted(m.files):
        if hashes[n]["sha256"] != m.files[n]["sha256"]:
            raise CheckpointError(f"{folder / n}: sha256 {hashes[n]['sha256'][:16]}..., the manifest says "
                                  f"{m.files[n]['sha256'][:16]}... (corrupted); load an older checkpoint.")
    return m


def write_durably(path: Path, data: bytes) -> None:
    """Write via a temporary file, fsync, then rename over `path`: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*"), reverse=True):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
        else:
            fsync_dir(p)
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
