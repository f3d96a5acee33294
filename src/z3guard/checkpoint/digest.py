"""Content hashes of checkpoint files: sha256 of each 256 MiB block, taken from the bytes as they are
written and checked on load by several threads at once.

A whole-file sha256 is one sequential stream: for a 70B model's terabyte of files that is a second read of
everything after each save and one before each load, at ~0.5-2 GB/s per core. Block hashes are computed
while DeepSpeed's own `torch.save` hands its bytes over (on a second thread, so writing and hashing
overlap), and verified block by block in parallel. A file of one block has the file's sha256 as its only
block hash."""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

BLOCK = 1 << 28
READ = 1 << 23  # bytes per read when hashing a file from disk
OVERLAP = 1 << 20  # writes at least this large are hashed on another thread while being written


def threads() -> int:
    """Hashing threads for this rank: the CPUs it may use (affinity mask and container quota) shared with
    the other ranks of its node. hashlib releases the GIL, so they run in parallel."""
    from ..adapter.hostthreads import usable_cpus

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(16, usable_cpus() // max(1, per_node)))


class HashingWriter:
    """A binary file opened for writing that hashes its blocks as bytes arrive. `torch.save` writes to it as
    to any file object (it needs only `write` and `flush`); there is deliberately no `fileno`, which would let
    the legacy format write around it.

    With `sync`, the file goes to disk as it is written (each finished block handed to the disk at once)
    and `synced()` waits until it is there: for a save that is durable before it is published. Without,
    the bytes stay in the page cache, as stock's `torch.save` leaves them: a disk write-back running beside
    the writes slows them to the disk's rate (measured), and the published folder is synced afterwards."""

    def __init__(self, path: str | os.PathLike, pool: ThreadPoolExecutor, sync: bool = True):
        self.path = Path(path)
        self._file = self.path.open("wb")
        self._pool = pool
        self._blocks: list[Any] = []
        self._current = hashlib.sha256()
        self._filled = 0
        self.size = 0
        self._sync = sync
        self._flusher: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="z3guard-writeback")
        self._syncs: list[Any] = []  # this file's fdatasyncs, in order; the last one ends with the close

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        parts = []  # (block hasher, bytes of that block, whether they end it)
        pos = 0
        while pos < len(view):
            take = min(BLOCK - self._filled, len(view) - pos)
            self._filled += take
            parts.append((self._current, view[pos:pos + take], self._filled == BLOCK))
            pos += take
            if self._filled == BLOCK:
                self._blocks.append(self._current)
                self._current, self._filled = hashlib.sha256(), 0
        if len(view) < OVERLAP:
            for h, part, _ in parts:
                h.update(part)
            self._file.write(view)
        else:  # hashed on other threads while written here; each block's parts in order, as each write waits
            pending = [self._pool.submit(h.update, part) for h, part, _ in parts]
            for _, part, ends in parts:
                self._file.write(part)
                if ends and self._sync:
                    self._write_back()
            for f in pending:
                f.result()
        self.size += len(view)
        return len(view)

    def _write_back(self) -> None:
        """Start the disk writes of what is written so far (fdatasync on a thread of its own, at most one at
        a time): the save then waits for the last block only, not for all of them, while DeepSpeed goes on
        serializing."""
        if self._syncs and not self._syncs[-1].done():
            return
        self._file.flush()
        assert self._flusher is not None
        self._syncs.append(self._flusher.submit(os.fdatasync, self._file.fileno()))

    def __str__(self) -> str:  # DeepSpeed's writer logs the path it was given
        return str(self.path)

    def flush(self) -> None:
        self._file.flush()

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        """With `sync`, hands the file's last bytes to the disk and closes it on the write-back thread, so
        that the next file's serialization overlaps them (`synced` waits for that); without, closes it."""
        if self._flusher is None:
            return
        flusher, self._flusher = self._flusher, None
        try:
            self._file.flush()
        except BaseException:
            self._file.close()
            flusher.shutdown(wait=True)
            raise
        if self._sync:
            self._syncs.append(flusher.submit(self._sync_and_close))
        else:
            self._file.close()
        flusher.shutdown(wait=False)

    def _sync_and_close(self) -> None:
        try:
            os.fdatasync(self._file.fileno())
        finally:
            self._file.close()

    def synced(self) -> None:
        """Waits until the file is on disk and closed, and raises the first write-back error (an early
        fdatasync that failed counts: the kernel reports a write-back error to a file once)."""
        if self._flusher is not None:
            raise RuntimeError(f"{self.path}: synced() before close()")
        for sync in self._syncs:
            sync.result()

    def written(self) -> None:
        """Raises unless every byte was handed to the kernel (the file was closed): what a save that is
        synced after it is published checks before it publishes."""
        if self._flusher is not None:
            raise RuntimeError(f"{self.path}: still open after DeepSpeed's save")

    def entry(self) -> dict[str, Any]:
        """The manifest entry of what was written: size and block hashes."""
        blocks = self._blocks + ([self._current] if self._filled or not self._blocks else [])
        return {"size": self.size, "sha256_blocks": [h.hexdigest() for h in blocks]}


def _block(path: Path, index: int, size: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(index * BLOCK)
        left = min(BLOCK, size - index * BLOCK)
        while left > 0:
            chunk = f.read(min(READ, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def hash_files(paths: Iterable[Path], pool: ThreadPoolExecutor) -> dict[Path, dict[str, Any]]:
    """The manifest entries of `paths`, read from disk, all their blocks hashed in parallel."""
    jobs = {}
    for p in paths:
        size = p.stat().st_size
        jobs[p] = (size, [pool.submit(_block, p, i, size) for i in range(max(1, -(-size // BLOCK)))])
    return {p: {"size": size, "sha256_blocks": [f.result() for f in blocks]} for p, (size, blocks) in jobs.items()}


def mismatch(path: Path, entry: dict[str, Any], pool: ThreadPoolExecutor) -> str | None:
    """Why `path` does not match its manifest `entry` (None when it does). Entries written before block
    hashes hold one whole-file "sha256"."""
    size = path.stat().st_size
    if "sha256_blocks" not in entry:
        whole = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(READ):
                whole.update(chunk)
        got, want = whole.hexdigest(), entry["sha256"]
        return None if got == want else f"sha256 {got[:16]}..., the manifest says {want[:16]}..."
    want = entry["sha256_blocks"]
    got = [f.result() for f in [pool.submit(_block, path, i, size) for i in range(len(want))]]
    bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    if bad is None:
        return None
    return (f"block {bad} (bytes {bad * BLOCK}-{min(size, (bad + 1) * BLOCK) - 1}) has sha256 "
            f"{got[bad][:16]}..., the manifest says {want[bad][:16]}...")
