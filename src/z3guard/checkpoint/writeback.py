"""A published checkpoint's way to the disk, on a thread of its own while training goes on.

Stock DeepSpeed's save returns with its bytes in the page cache and leaves the write-back to the kernel,
unchecked. z3guard's save (unless `GuardOptions.durable_saves`) publishes the checkpoint at the same
point, then syncs its files, its folders and `latest` here. A process that exits waits for this thread
(concurrent.futures joins its workers at exit). The next save first waits for it on every rank and fails
on all of them, naming the checkpoint, if the disk reported an error: it is the disk's one report of it."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from . import dist, faults
from .errors import CheckpointError

log = logging.getLogger("z3guard")


class WriteBack:
    """At most one save's write-back in flight for one engine."""

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._tag = ""
        self.durable_seconds: float | None = None  # the last save's, from its start until it was on disk

    def start(self, tag: str, syncs: Sequence[Callable[[], None]], began: float) -> None:
        """Run `syncs` (the fsyncs of what the save wrote and renamed); `began` is when the save started."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="z3guard-writeback")
        self._tag, self.durable_seconds = tag, None
        self._pending = self._thread.submit(self._run, tag, list(syncs), began)

    def _run(self, tag: str, syncs: list[Callable[[], None]], began: float) -> None:
        try:
            faults.point(faults.WRITE_BACK, tag)
            for sync in syncs:
                try:
                    sync()
                except FileNotFoundError:  # removed before it reached the disk: nothing left to sync
                    pass
        except Exception as exc:
            log.error("z3guard: the disk reported an error writing checkpoint '%s' back after it was published: "
                      "%s", tag, exc)
            raise
        self.durable_seconds = time.perf_counter() - began

    def finish(self) -> None:
        """Waits for the last save's write-back. Every rank calls this at the same point of a save (one
        collective, only while a write-back is pending, as it is on all ranks alike); an error on any rank
        is raised on all."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        problem = None
        try:
            pending.result()
        except Exception as exc:
            problem = (f"rank {dist.rank()}: the disk reported an error writing checkpoint '{self._tag}' back "
                       f"after it was published: {exc}. That checkpoint may not survive a restart of the machine "
                       "(its load's verification names any torn file), and the disk may be failing. With "
                       "durable_saves=on each save waits for the disk and fails itself instead.")
        dist.raise_if_any(problem, CheckpointError)

    def wait(self) -> None:
        """Waits for the last save's write-back on this rank alone, logging (not raising) its error: for
        teardown, where no collective may be started."""
        if self._pending is not None:
            try:
                self._pending.result()
            except Exception:
                pass  # logged by the thread
