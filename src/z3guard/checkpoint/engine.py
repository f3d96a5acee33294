"""Staged, atomic, verified `save_checkpoint`/`load_checkpoint` for one DeepSpeed engine."""
from __future__ import annotations

import functools
import inspect
import logging
import os
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from .. import __version__
from ..adapter import installed_release
from . import digest, dist, faults, manifest, state, storage
from .errors import CheckpointError
from .writeback import WriteBack

log = logging.getLogger("z3guard")
STAGING = ".z3guard-staging"


class CheckpointGuard:
    """Replaces the engine's save/load methods (instance attributes: Trainer and accelerate call
    those) with staged, verified ones that keep DeepSpeed's signatures; `remove()` undoes that."""

    def __init__(self, engine: Any, adapter: Any, durable: bool = False):
        self.engine = engine
        self.adapter = adapter
        self.durable = durable  # GuardOptions.durable_saves: fsync before publishing, not after
        self.write_back = WriteBack()
        self.data_position: Any = None  # set by the caller (z3guard.set_data_position); saved per rank
        self.resumed_state: dict[str, Any] | None = None
        self._warned_async = False
        self._save: Callable = engine.save_checkpoint
        self._load: Callable = engine.load_checkpoint
        self._own = {"save_checkpoint": _keeping_signature(engine, "save_checkpoint", self.save),
                     "load_checkpoint": _keeping_signature(engine, "load_checkpoint", self.load)}
        self._shadowed = {name: engine.__dict__.get(name) for name in self._own}  # a wrapper set before ours
        for name, method in self._own.items():
            setattr(engine, name, method)

    def remove(self) -> None:
        self.write_back.wait()
        for name, method in self._own.items():
            if self.engine.__dict__.get(name) is not method:  # something wrapped ours since: leave it in place
                log.warning("z3guard: %s was wrapped again after z3guard; that wrapper still calls z3guard's", name)
                continue
            if self._shadowed[name] is None:
                delattr(self.engine, name)
            else:
                setattr(self.engine, name, self._shadowed[name])

    # -- facts about the engine --------------------------------------------------------------
    def dtype(self) -> str:
        e = self.engine
        return "fp16" if e.fp16_enabled() else "bf16" if e.bfloat16_enabled() else "fp32"

    def _manifest(self, tag: str, store: storage.Storage) -> manifest.Manifest:
        return manifest.Manifest(tag=tag, world_size=dist.world(), zero_stage=self.engine.zero_optimization_stage(),
                                 dtype=self.dtype(), global_step=int(self.engine.global_steps),
                                 deepspeed=installed_release(), torch=torch.__version__, z3guard=__version__,
                                 storage=store.index, storages=store.count)

    # -- save --------------------------------------------------------------------------------
    def save(self, save_dir: str, tag: Any = None, client_state: dict | None = None, save_latest: bool = True,
             **kwargs: Any) -> bool:
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")  # as stock says it
        if self.adapter.saves_asynchronously(self.engine):  # its files land after this returns: no staging
            if not self._warned_async:
                log.warning("z3guard: the engine's checkpoint engine writes asynchronously (decoupled); its saves "
                            "are DeepSpeed's own, without z3guard's staging, manifest and saved RNG streams")
                self._warned_async = True
            return self._save(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest, **kwargs)
        began = time.perf_counter()
        self.write_back.finish()  # the last save's: on disk now, or its error raised on every rank
        root = Path(save_dir)
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        final, staging = root / tag, root / STAGING / tag
        store = storage.of(root, self.adapter.node_local_storage(self.engine))
        problem = _target_problem(root, final)
        if problem is None and store.leads:
            try:
                problem = _claim(root / STAGING, tag)
            except OSError as exc:
                problem = f"{root / STAGING}: cannot take the save lock of checkpoint '{tag}': {exc}"
        dist.raise_if_any(problem, CheckpointError)
        renaming, durable = False, self.durable
        try:  # rmtree: a staging folder left by a save that died
            _agreed(lambda: (shutil.rmtree(staging, ignore_errors=True), staging.mkdir(parents=True)), store)
            faults.point("before-data", tag)
            writers: list[digest.HashingWriter] = []  # this rank's files, hashed as they are written
            with ThreadPoolExecutor(digest.threads()) as pool:
                _agreed(lambda: self._deepspeed_save(root / STAGING, tag, client_state or {}, kwargs,
                                                     _opening_into(writers, pool, durable)))
                faults.point("mid-data", tag)
                _agreed(lambda: (state.save(staging, state.capture(self.adapter.loss_scaler_state(self.engine),
                                                                   self.data_position)),
                                 [w.synced() if durable else w.written() for w in writers]))  # or its error
                faults.point("before-manifest", tag)
                m = self._manifest(tag, store)
                written = {str(w.path.relative_to(staging)): w.entry() for w in writers
                           if w.path.is_relative_to(staging)}
                m.files = storage.entries(staging, store, written, pool)
            _agreed(lambda: (durable and manifest.fsync_tree(staging), m.write(staging, durable)), store)
            faults.point("before-rename", tag)
            renaming = True  # the checkpoint appears whole (on each filesystem), or not at all
            _agreed(lambda: _publish(staging, final), store)
            _agreed(lambda: durable and manifest.fsync_dir(root), store)
            faults.point("before-latest", tag)  # every filesystem has committed its part
            _agreed(lambda: save_latest and manifest.write_durably(root / "latest", tag.encode(), durable), store)
        except Exception as exc:  # torch.save reports a failed write as RuntimeError, not OSError
            if store.leads:
                shutil.rmtree(staging, ignore_errors=True)
                _release(root / STAGING, tag)
            outcome = (f"'{tag}' may be in place (verify it with z3guard check-checkpoint)" if renaming else
                       "Nothing was published")
            raise CheckpointError(f"saving checkpoint '{tag}' into {root} failed: {exc}. {outcome}; "
                                  f"'latest' still points to {_latest(root)!r}.") from exc
        if store.leads:
            _release(root / STAGING, tag)
        if not durable:  # published as stock's save returns: with its bytes still on their way to the disk
            syncs = [lambda: manifest.fsync_tree(final), lambda: manifest.fsync_file(root / "latest"),
                     lambda: manifest.fsync_dir(root)] if store.leads else []
            self.write_back.start(tag, syncs, began)
        return True

    def _deepspeed_save(self, folder: Path, tag: str, client_state: dict, kwargs: dict[str, Any],
                        open_file: Callable[[str], Any]) -> None:
        """DeepSpeed's own save into the staging folder; a write that failed on this rank is raised once
        DeepSpeed's collectives are done, so every rank reaches the agreement after it."""
        with self.adapter.guarded_writes(self.engine, open_file) as errors:
            self._save(str(folder), tag=tag, client_state=client_state, save_latest=False, **kwargs)
        if errors:
            raise errors[0]

    # -- load --------------------------------------------------------------------------------
    def _other_world(self, folder: Path, universal: bool) -> Any:
        """The saved layout, when `folder` was saved on another number of ranks and can be re-partitioned
        here (every rank agrees, or all raise CheckpointError naming why not); None when saved on this many
        or loaded as DeepSpeed's universal checkpoint."""
        saved, problem = None, None
        try:
            saved = _saved_world(folder) if self.engine.zero_optimization_stage() == 3 and not universal else None
        except Exception as exc:  # a corrupt manifest or model-states file: torch.load raises many types
            problem = f"{folder}: cannot tell how many ranks saved it: {exc}"
        views = dist.gather_all((saved, problem))
        dist.raise_if_any(next((p for _, p in views if p), None) or (
            None if len({s for s, _ in views}) == 1 else
            f"{folder}: the ranks read different saved world sizes {[s for s, _ in views]} from their copies"),
            CheckpointError)
        if saved is None or saved == dist.world():
            return None
        layout, problem = None, None
        try:
            layout = self.adapter.saved_layout(folder)
            names = {id(p): n for n, p in self.engine.module.named_parameters()}
            found = self.adapter.reshard_problems(layout, self.engine, names)
            if found:
                problem = (f"{folder}: saved on {saved} ranks, loading on {dist.world()}: " + "; ".join(found)
                           + f". Or convert it with DeepSpeed's universal checkpoint (python -m "
                           f"deepspeed.checkpoint.ds_to_universal --input_folder {folder} --output_folder OUT).")
        except CheckpointError as exc:
            problem = str(exc)
        dist.raise_if_any(problem, CheckpointError)
        log.warning("z3guard: %s was saved on %d ranks; re-partitioning it for %d", folder, saved, dist.world())
        return layout

    def load(self, load_dir: str, tag: Any = None, **kwargs: Any):
        root = Path(load_dir)
        universal = bool(getattr(self.engine, "load_universal_checkpoint", lambda: False)())
        tag = _agreed_tag(root, tag, universal)
        if tag is None:  # no checkpoint there: stock's answer, (None, None) or its ValueError
            return self._load(str(root), tag=None, **kwargs)
        folder = root / tag
        _restore_replaced(root, tag)
        dist.raise_if_any(None if folder.is_dir() else f"{folder}: no such checkpoint folder (tag {tag!r}); "
                          f"checkpoints in {root}: {_checkpoint_tags(root) or 'none'}.", CheckpointError)
        layout = self._other_world(folder, universal)
        listed = dist.gather_all((folder / manifest.MANIFEST).exists())
        if all(listed):  # raises on every rank
            began = time.perf_counter()
            manifest.verify(folder, world_size=None if layout else dist.world(),
                            zero_stage=self.engine.zero_optimization_stage(), dtype=self.dtype())
            log.info("z3guard: %s verified in %.2f s", folder, time.perf_counter() - began)
        elif any(listed):
            raise CheckpointError(f"{folder}: ranks {[r for r, x in enumerate(listed) if x]} find its "
                                  f"{manifest.MANIFEST}, ranks {[r for r, x in enumerate(listed) if not x]} do not: "
                                  "a node's copy is incomplete; load an older checkpoint.")
        else:
            log.warning("z3guard: %s has no %s (written without z3guard): loading it unverified",
                        folder, manifest.MANIFEST)
        if layout is None:
            result = self._load(str(root), tag=tag, **kwargs)
        else:
            with self.adapter.resharding(self.engine, layout):
                result = self._load(str(root), tag=tag, **kwargs)
        saved = state.load(folder, layout.world if layout else None)
        if saved is not None and not kwargs.get("load_module_only"):  # a warm start keeps this run's streams
            state.restore(saved)
            self.data_position = saved.get("data_position")
            if layout is not None:  # what a caller needs to derive its per-rank position from the saved one
                saved = {**saved, "saved_world_size": layout.world, "saved_rank": dist.rank() % layout.world}
            self.resumed_state = saved
        return result


def _agreed_tag(root: Path, tag: Any, universal: bool) -> str | None:
    """The tag every rank loads: `tag`, else the one `latest` names (None where `root` holds no checkpoint).
    Ranks that would load different ones (node-local folders whose `latest` differ) are refused on all."""
    answer, problem = (str(tag) if tag is not None else None), None
    latest = root / ("latest_universal" if universal else "latest")
    if tag is None and latest.is_file():
        answer = latest.read_text().strip()
    elif tag is None and not universal and (tags := _checkpoint_tags(root)):
        problem = (f"{latest}: missing, though {root} holds checkpoints {tags}; loading nothing would silently "
                   f"restart from scratch. Pass tag=... or restore '{latest.name}'.")
    views = dist.gather_all((answer, problem))
    problems = [p for _, p in views if p]
    if problems:
        raise CheckpointError(problems[0])
    if len({a for a, _ in views}) > 1:
        raise CheckpointError(f"{root}: the ranks would resume from different checkpoints ("
                              + ", ".join(f"rank {r}: {a!r}" for r, (a, _) in enumerate(views))
                              + "); their folders' 'latest' differ. Pass tag=... to load one they all hold.")
    return answer


def _restore_replaced(root: Path, tag: str) -> None:
    """A save that replaced `tag` and died between its two renames left the old one aside: put it back (by
    any rank that sees it; a filesystem's ranks race for one rename)."""
    folder, replaced = root / tag, root / STAGING / f"{tag}.replaced"
    needed = not folder.is_dir() and replaced.is_dir()
    dist.gather_all(needed)  # every rank has looked before any renames
    if needed:
        try:
            os.rename(replaced, folder)
            log.warning("z3guard: restored %s from %s (a save replacing it was interrupted)", folder, replaced)
        except FileNotFoundError:
            pass
    dist.barrier()


def _saved_world(folder: Path) -> int | None:
    """The number of ranks a checkpoint was saved on: its manifest's, else DeepSpeed's own record (read only
    when its count of model-state files is not this run's world size)."""
    if (folder / manifest.MANIFEST).exists():
        return manifest.Manifest.read(folder).world_size
    states = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if len(list(folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))) == dist.world():
        return dist.world()
    if states.is_file():
        return int(torch.load(states, map_location="cpu", weights_only=False).get("dp_world_size", 0)) or None
    return None


def _agreed(action: Callable[[], Any], store: storage.Storage | None = None) -> None:
    """A save phase: this rank's part (with `store`, each filesystem's lead rank's alone), then agreement
    across ranks."""
    def part() -> None:
        if store is None or store.leads:
            action()

    dist.on_every_rank(part, CheckpointError)


def _opening_into(writers: list[digest.HashingWriter], pool: ThreadPoolExecutor, sync: bool) -> Callable:
    """A file opener for DeepSpeed's writer that keeps each writer in `writers`: their hashes make the
    manifest's entries, and with `sync` their files are still being synced to disk when DeepSpeed's save
    returns."""
    def open_file(path: str) -> digest.HashingWriter:
        writers.append(digest.HashingWriter(path, pool, sync))
        return writers[-1]

    return open_file


def _claim(staging_root: Path, tag: str) -> str | None:
    """Take the save lock of `tag`; a live save of the same tag elsewhere makes this one refuse."""
    staging_root.mkdir(parents=True, exist_ok=True)
    lock = staging_root / f"{tag}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        holder = _lock_holder(lock)
        if holder is not None:
            return (f"{lock}: another save of checkpoint '{tag}' is in progress (process {holder}); two saves "
                    "of one tag at once would mix their files. Wait for it, or save under another tag.")
        fd = os.open(lock, os.O_WRONLY | os.O_TRUNC)  # left by a save that died
    with os.fdopen(fd, "w") as f:
        f.write(f"{socket.gethostname()}:{os.getpid()}")
    return None


def _lock_holder(lock: Path) -> str | None:
    """Who holds `lock`, if it is a live process on this host other than this one; a lock written on
    another host (a requeued job) cannot be checked and is taken as left by a save that died there."""
    try:
        host, _, pid = lock.read_text().rpartition(":")
        pid_n = int(pid)
    except (OSError, ValueError):
        return None
    if pid_n <= 0 or (host or socket.gethostname()) != socket.gethostname() or pid_n == os.getpid() or \
            not _alive(pid_n):
        return None
    return str(pid_n)


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


def _keeping_signature(engine: Any, name: str, replacement: Callable) -> Callable:
    """`replacement` behind DeepSpeed's own signature of the method `name` (not that of a wrapper set
    before z3guard's): Trainer inspects it (`exclude_frozen_parameters`), and positional arguments reach
    `replacement` by name."""
    stock = getattr(type(engine), name)
    with_self = inspect.signature(stock)
    signature = with_self.replace(parameters=list(with_self.parameters.values())[1:])

    @functools.wraps(stock)
    def method(*args: Any, **kwargs: Any) -> Any:
        named: dict[str, Any] = {}
        for param, value in signature.bind(*args, **kwargs).arguments.items():
            if signature.parameters[param].kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[param] = value
        return replacement(**named)

    method.__signature__ = signature  # type: ignore[attr-defined]
    return method


def _checkpoint_tags(root: Path) -> list[str]:
    """Folders under `root` that hold a checkpoint (a z3guard manifest or DeepSpeed's model states)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and ((p / manifest.MANIFEST).exists() or any(p.glob("*model_states.pt"))))
