"""What a checkpoint folder holds and whether it verifies (for `z3guard check-checkpoint`)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import digest
from .errors import CheckpointError
from .manifest import MANIFEST, Manifest, listing, verify


@dataclass
class FileRow:
    name: str
    size: int
    status: str  # ok | missing | size | hash | unlisted | unverified


@dataclass
class Inspection:
    folder: Path
    manifest: Manifest | None
    files: list[FileRow] = field(default_factory=list)
    verdict: str = ""  # verified | FAILED: ... | unverifiable: ...
    ok: bool = False
    loads_on: str = ""  # the numbers of ranks it can be loaded on


def resolve(path: Path, tag: str | None = None) -> Path:
    """A save folder (with `latest`), or a tag folder itself."""
    path = Path(path)
    if tag:
        return path / tag
    if (path / MANIFEST).exists() or not (path / "latest").exists():
        return path
    return path / (path / "latest").read_text().strip()


def loads_on(folder: Path) -> str:
    """From which numbers of ranks a ZeRO-3 checkpoint can be loaded, from its own files."""
    from ..adapter.reshard import read_layout

    try:
        layout = read_layout(folder)
    except CheckpointError as exc:
        return f"not re-partitionable: {exc}"
    except Exception as exc:  # a file torch cannot read: the verdict above says which
        return f"not readable ({type(exc).__name__})"
    n = layout.world
    if layout.frozen:
        return f"{n} ranks only: it holds {len(layout.frozen)} frozen parameter(s), saved as per-rank fragments"
    return f"any number of ranks under z3guard (re-partitioned at load); stock DeepSpeed: {n} only"


def inspect(path: Path, tag: str | None = None) -> Inspection:
    found = _inspect(path, tag)
    if found.folder.is_dir() and (found.folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file():
        found.loads_on = loads_on(found.folder)
    return found


def _inspect(path: Path, tag: str | None = None) -> Inspection:
    folder = resolve(path, tag)
    if not folder.is_dir():
        return Inspection(folder, None, verdict=f"FAILED: {folder} is not a folder")
    if not (folder / MANIFEST).exists():
        rows = [FileRow(n, (folder / n).stat().st_size, "unverified") for n in listing(folder)]
        return Inspection(folder, None, rows, f"unverifiable: no {MANIFEST} (written without z3guard)")
    try:
        m = Manifest.read(folder)
    except CheckpointError as exc:
        return Inspection(folder, None, verdict=f"FAILED: {exc}")
    rows = []
    with ThreadPoolExecutor(digest.threads()) as pool:
        for name, meta in sorted(m.files.items()):
            p = folder / name
            if not p.is_file():
                rows.append(FileRow(name, meta["size"], "missing"))
            elif p.stat().st_size != meta["size"]:
                rows.append(FileRow(name, p.stat().st_size, "size"))
            elif digest.mismatch(p, meta, pool):
                rows.append(FileRow(name, meta["size"], "hash"))
            else:
                rows.append(FileRow(name, meta["size"], "ok"))
    rows += [FileRow(n, (folder / n).stat().st_size, "unlisted") for n in listing(folder) if n not in m.files]
    if all(r.status in ("ok", "unlisted") for r in rows):  # each listed file hashed once, above
        return Inspection(folder, m, rows, "verified", True)
    try:
        verify(folder)  # for its message, which names the first bad file and what to do
    except CheckpointError as exc:
        return Inspection(folder, m, rows, f"FAILED: {exc}")
    return Inspection(folder, m, rows, "FAILED: a file changed while it was being checked")
