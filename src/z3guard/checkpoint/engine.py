"""Staged, atomic, verified `save_checkpoint`/`load_checkpoint` for one DeepSpeed engine."""
from __future__ import annotations

import logging
import os
import shutil
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

import torch

from .. import __version__
from . import dist, faults, manifest, state
from .errors import CheckpointError

log = logging.getLogger("z3guard")
STAGING = ".z3guard-staging"


class CheckpointGuard:
    """Replaces the engine's save/load methods (instance attributes: Trainer and accelerate call
    those) with staged, verified ones; `remove()` puts the originals back."""

    def __init__(self, engine: Any, adapter: Any):
        self.engine = engine
        self.adapter = adapter
        self.data_position: Any = None  # set by the caller (z3guard.set_data_position); saved per rank
        self.resumed_state: dict[str, Any] | None = None
        self._save: Callable = engine.save_checkpoint
        self._load: Callable = engine.load_checkpoint
        engine.save_checkpoint = self.save
        engine.load_checkpoint = self.load

    def remove(self) -> None:
        self.engine.save_checkpoint = self._save
        self.engine.load_checkpoint = self._load

    # -- facts about the engine --------------------------------------------------------------
    def dtype(self) -> str:
        e = self.engine
        return "fp16" if e.fp16_enabled() else "bf16" if e.bfloat16_enabled() else "fp32"

    def _manifest(self, tag: str) -> manifest.Manifest:
        return manifest.Manifest(tag=tag, world_size=dist.world(), zero_stage=self.engine.zero_optimization_stage(),
                                 dtype=self.dtype(), global_step=int(self.engine.global_steps),
                                 deepspeed=version("deepspeed"), torch=torch.__version__, z3guard=__version__)

    # -- save --------------------------------------------------------------------------------
    def save(self, save_dir: str, tag: Any = None, client_state: dict | None = None, save_latest: bool = True,
             **kwargs: Any) -> bool:
        root = Path(save_dir)
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        final, staging = root / tag, root / STAGING / tag
        problem = _target_problem(root, final)
        if problem is None and dist.rank() == 0:
            problem = _claim(root / STAGING, tag)
        dist.raise_if_any(problem, CheckpointError)
        if dist.rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that died
            staging.mkdir(parents=True)
        dist.barrier()
        try:
            faults.point("before-data", tag)
            self._save(str(root / STAGING), tag=tag, client_state=client_state or {}, save_latest=False, **kwargs)
            faults.point("mid-data", tag)
            state.save(staging, state.capture(self.adapter.loss_scaler_state(self.engine), self.data_position))
            dist.barrier()
            faults.point("before-manifest", tag)
            m = self._manifest(tag)
            m.files = manifest.hash_files(staging, manifest.listing(staging))
            if dist.rank() == 0:
                manifest.fsync_tree(staging)
                m.write(staging)
            dist.barrier()
            faults.point("before-rename", tag)
            if dist.rank() == 0:
                _publish(staging, final)  # the checkpoint appears whole, or not at all
                manifest.fsync_dir(root)
            dist.barrier()
            faults.point("before-latest", tag)
            if save_latest and dist.rank() == 0:
                manifest.write_durably(root / "latest", tag.encode())
            dist.barrier()
        except Exception as exc:  # torch.save reports a failed write as RuntimeError, not OSError
            if dist.rank() == 0:
                shutil.rmtree(staging, ignore_errors=True)
                _release(root / STAGING, tag)
            raise CheckpointError(f"saving checkpoint '{tag}' into {root} failed: {exc}. Nothing was published; "
                                  f"'latest' still points to {_latest(root)!r}.") from exc
        if dist.rank() == 0:
            _release(root / STAGING, tag)
        return True

    # -- load --------------------------------------------------------------------------------
    def load(self, load_dir: str, tag: Any = None, **kwargs: Any):
        root = Path(load_dir)
        if tag is None:
            latest = root / "latest"
            if not latest.is_file():
                tags = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
                    if root.is_dir() else []
                raise CheckpointError(f"{latest}: missing, so there is no checkpoint to resume from by default; "
                                      f"tags present: {tags or 'none'}. Pass tag=... or restore 'latest'.")
            tag = latest.read_text().strip()
        folder = root / str(tag)
        replaced = root / STAGING / f"{tag}.replaced"
        if not folder.is_dir() and replaced.is_dir():  # a replacing save died between its two renames
            dist.barrier()
            if dist.rank() == 0:
                log.warning("z3guard: restoring %s from %s (a save replacing it was interrupted)", folder, replaced)
                os.rename(replaced, folder)
            dist.barrier()
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: no such checkpoint folder (tag {tag!r}).")
        if (folder / manifest.MANIFEST).exists():
            problem = None
            try:
                manifest.verify(folder, world_size=dist.world(), zero_stage=self.engine.zero_optimization_stage(),
                                dtype=self.dtype())
            except CheckpointError as exc:
                problem = str(exc)
            dist.raise_if_any(problem, CheckpointError)
        else:
            log.warning("z3guard: %s has no %s (written without z3guard): loading it unverified",
                        folder, manifest.MANIFEST)
        result = self._load(str(root), tag=tag, **kwargs)
        saved = state.load(folder)
        if saved is not None:
            state.restore(saved)
            self.data_position = saved.get("data_position")
            self.resumed_state = saved
        return result


def _claim(staging_root: Path, tag: str) -> str | None:
    """Take the save lock of `tag`; a live save of the same tag elsewhere makes this one refuse."""
    staging_root.mkdir(parents=True, exist_ok=True)
    lock = staging_root / f"{tag}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            pid = int(lock.read_text() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and pid != os.getpid() and _alive(pid):
            return (f"{lock}: another save of checkpoint '{tag}' is in progress (process {pid}); two saves of "
                    "one tag at once would mix their files. Wait for it, or save under another tag.")
        fd = os.open(lock, os.O_WRONLY | os.O_TRUNC)  # left by a save that died
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return None


def _release(staging_root: Path, tag: str) -> None:
    # DeepSpeed copies its recovery scripts (zero_to_fp32.py, ...) into the folder it saved to.
    for script in staging_root.glob("*.py"):
        os.replace(script, staging_root.parent / script.name)
    (staging_root / f"{tag}.lock").unlink(missing_ok=True)
    try:
        staging_root.rmdir()  # only when no other save is staging there
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _publish(staging: Path, final: Path) -> None:
    """Rename the finished checkpoint into place. An existing one of the same tag is moved aside first
    and deleted only once the new one is in place (a crash in between is repaired on load)."""
    if not final.exists():
        os.rename(staging, final)
        return
    replaced = staging.parent / f"{final.name}.replaced"
    shutil.rmtree(replaced, ignore_errors=True)
    os.rename(final, replaced)
    os.rename(staging, final)
    shutil.rmtree(replaced)


def _target_problem(root: Path, final: Path) -> str | None:
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    if not os.access(probe, os.W_OK):
        return f"{probe}: not writable, cannot save checkpoint '{final.name}' there."
    return None


def _latest(root: Path) -> str | None:
    try:
        return (root / "latest").read_text().strip()
    except OSError:
        return None
