"""Ranks that run different modules stop together, with an error that names the module, never a hang.

ZeRO-3 gathers a module's parameters with a collective when the module runs, so every rank must run the
same modules in the same order (so must FSDP). When a batch makes one rank run a module that another
skips (rank 0's batch has images, rank 1's none), stock DeepSpeed issues collectives that no longer
pair: a hang, an abort, or gathers of equal size that exchange the wrong parameters.

A rank's trace machinery tells it when it leaves its plan: a module outside the recorded order, a new
parameter set, a fetch while the trace is being recorded, a first read of a partitioned parameter. At
each such point, before any collective for it, the rank posts what it is about to do to the process
group's key-value store (the one `init_process_group` made: it is served outside the ranks' collectives)
and waits for every rank to post the same. Ranks that run the same code reach the same points, so this
costs a few store round trips per module of a recording step and per order change, and on a step that
follows its recorded trace a note per fetch and no communication. When a rank is missing, every rank's watcher thread answers with the modules its rank
ran this step; the first place where two ranks differ is the error, posted for all to raise. A rank that
never arrives is given `timeout` seconds.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ..diagnose import RankDivergenceError

log = logging.getLogger("z3guard")

POLL = 0.2  # seconds between the watcher's looks at the store
FIRST_WAIT = 1.0  # seconds to wait for the other ranks' posts before asking where they are
GRACE = 5.0  # seconds for a rank's main thread to raise the verdict before its process is ended
_engines = 0  # engines given a Lockstep in this process: the same count on every rank, so the same keys
_watching: "weakref.WeakSet[Lockstep]" = weakref.WeakSet()


@atexit.register
def _stop_watchers() -> None:
    """Before the interpreter (and the store's client) goes: a thread still inside a store call at exit
    aborts the process ("terminate called without an active exception")."""
    for lockstep in list(_watching):
        lockstep.close()
        if lockstep._thread is not None:
            lockstep._thread.join(timeout=2 * POLL)


Event = tuple  # ("fwd" | "bwd" | "read", module index[, parameter index])


class Lockstep:
    """One engine's agreement on events over its data-parallel group's store."""

    def __init__(self, group: Any, timeout: float, describe: Callable[[list], str]) -> None:
        global _engines
        self.timeout = timeout
        self.describe = describe  # an event (as posted) -> words naming the module and parameter
        self.store = None
        self.verdict: str | None = None
        self.boundary = 0  # step boundaries passed (the coordinator's reset_step): the same on every rank
        self.events: list[list] = []  # this boundary's events
        self.previous: list[list] = []  # the last boundary's
        self._consults = 0
        self._raised = False  # the main thread raised the verdict itself
        self._closed = False
        self._stopped = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._main = threading.get_ident()  # the thread that trains (builds the engine)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
            return
        try:
            store = dist.distributed_c10d._get_default_store()
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        except Exception as exc:  # an unexpected torch: go on without it, as stock would
            log.warning("z3guard: no key-value store to check that ranks run the same modules (%s)", exc)
            return
        _engines += 1
        self.rank, self.world = dist.get_rank(group), len(ranks)
        self.store = dist.PrefixStore(f"z3guard/lockstep/{_engines}/{min(ranks)}/", store)
        self._start_watcher()  # from the start: a rank that is still far behind answers where it is

    @property
    def active(self) -> bool:
        return self.store is not None

    # -- the main thread ------------------------------------------------------------------
    def note(self, event: list) -> None:
        self.events.append(event)

    def at_boundary(self) -> None:
        self.previous, self.events = self.events, []
        self.boundary += 1

    def agree(self, event: list) -> None:
        """Note `event` and return once every rank has posted the same one; raise RankDivergenceError on
        every rank if one posts another, or none arrives within the timeout."""
        self.note(event)
        if not self.active:
            return
        try:
            self._agree(event)
        except RankDivergenceError:
            raise
        except Exception as exc:  # the store failed us: go on unchecked, as stock does (fail safe)
            log.warning("z3guard: the ranks can no longer check that they run the same modules (%s: %s)",
                        type(exc).__name__, exc)
            self.store = None

    def _agree(self, event: list) -> None:
        c = self._consults
        self._consults += 1
        mine = json.dumps([self.boundary, len(self.events) - 1, event])
        keys = [f"c/{c}/{r}" for r in range(self.world)]
        self.store.set(keys[self.rank], mine)
        began = time.monotonic()
        try:  # the store wakes this rank as the last key arrives: no polling on the path every step takes
            self.store.wait(keys, timedelta(seconds=FIRST_WAIT))
        except RuntimeError:  # not every rank has posted yet: where are they?
            while True:
                self._check_verdict()
                self._judge(time.monotonic() - began)
                if self._posted(keys, POLL * 2):
                    break
        posted = self._get(keys)
        if any(p != mine for p in posted):
            self._judge(time.monotonic() - began, posted=[json.loads(p) for p in posted])
        if c:  # every rank is past consult c - 1 now
            self.store.delete_key(f"c/{c - 1}/{self.rank}")

    def close(self) -> None:
        """The engine is no longer guarded: the watcher stops at its next look."""
        self._closed = True

    def raise_if_decided(self, cause: BaseException | None = None) -> None:
        """After a collective failed: the ranks' verdict in its place, if there is one."""
        if self.active:
            try:
                self._check_verdict(cause)
            except RankDivergenceError:
                raise
            except Exception:  # no store left: the collective's own error stands
                pass

    # -- deciding ---------------------------------------------------------------------------
    def _judge(self, waited: float, posted: list | None = None) -> None:
        """Raise on every rank if the ranks ran different events; return to keep waiting otherwise."""
        where = self._where()
        for rank, (boundary, events, complete) in where.items():
            if rank == self.rank or boundary != self.boundary:
                continue
            found = _first_difference(self.events, events, complete)
            if found is not None:
                self._decide(self._message((boundary, *found), rank))
        if posted is not None:  # every rank posted, not all the same, yet the histories agree: report them
            first = next(p for p in posted if p != posted[self.rank])
            self._decide(self._message((self.boundary, posted[self.rank][2], first[2]), posted.index(first)))
        if waited > self.timeout:
            late = sorted(r for r, (b, events, _) in where.items() if (b, len(events)) < (self.boundary, len(self.events)))
            self._decide(f"z3guard: rank {self.rank} waited {waited:.0f} s at {self.describe(self.events[-1])} "
                         f"(step boundary {self.boundary}) for rank(s) {late or 'unknown'}, which did not get "
                         f"there. {_FIX}")

    def _where(self) -> dict[int, tuple[int, list, bool]]:
        """Every rank's boundary, its events there and whether it has passed it, from its watcher (a rank
        one boundary ahead: its events at this one)."""
        ask = int(self.store.add("asks", 1))
        keys = [f"h/{ask}/{r}" for r in range(self.world)]
        self.store.set(keys[self.rank], self._snapshot())  # this rank's watcher waits for the store meanwhile
        self._posted(keys, max(self.timeout, 4 * POLL))
        where = {}
        for r, key in enumerate(keys):
            if self.store.check([key]):
                b, events, previous = json.loads(self.store.get(key))
                where[r] = (self.boundary, previous, True) if b == self.boundary + 1 else (b, events, False)
        return where

    def _snapshot(self) -> str:
        return json.dumps([self.boundary, list(self.events), list(self.previous)])

    def _message(self, found: tuple, rank: int) -> str:
        boundary, mine, theirs = found
        return (f"z3guard: the ranks ran different modules at step boundary {boundary}: rank {self.rank} "
                f"{self.describe(mine)} where rank {rank} {self.describe(theirs)}. {_FIX}")

    def _decide(self, message: str) -> None:
        self.store.compare_set("verdict", "", message)
        self._check_verdict()

    def _check_verdict(self, cause: BaseException | None = None) -> None:
        """On the main thread: raise the verdict, once every rank has seen it (or a moment has passed)."""
        if self.verdict is None and self.store.check(["verdict"]):
            self.verdict = self.store.get("verdict").decode()
        if self.verdict is not None:
            self._raised = True
            self._stop_group()
            raise RankDivergenceError(self.verdict) from cause

    def _stop_group(self) -> None:
        """Count this rank as having seen the verdict, wait briefly for the others, then abort this process's
        groups: a collective that another rank waits in with this one then fails at once, and that rank
        raises the verdict in its place instead of waiting for a partner that will never come."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self.store.add("seen", 1)
            deadline = time.monotonic() + max(2.0, 5 * POLL)
            while int(self.store.add("seen", 0)) < self.world and time.monotonic() < deadline:
                time.sleep(POLL / 4)
        except Exception:
            pass
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # a backend without abort: the process's end frees the others
            pass

    def _posted(self, keys: list[str], seconds: float) -> bool:
        """Whether all `keys` are in the store within `seconds` (looked at, not waited on: a store wait
        that runs out logs a warning in c10d, and here it would run out again and again while a rank is
        behind)."""
        deadline, pause = time.monotonic() + seconds, 0.0005
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, POLL / 4)
        return True

    def _get(self, keys: list[str]) -> list[str]:
        values = self.store.multi_get(keys) if hasattr(self.store, "multi_get") else [self.store.get(k) for k in keys]
        return [v.decode() for v in values]

    # -- the watcher thread ------------------------------------------------------------------
    def _start_watcher(self) -> None:
        if self._thread is None:
            _watching.add(self)
            self._thread = threading.Thread(target=self._watch, name="z3guard-lockstep", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        answered = 0
        try:
            while self.verdict is None:
                time.sleep(POLL)
                if self._closed:
                    return
                if self.store.check(["verdict"]):
                    self.verdict = self.store.get("verdict").decode()
                    break
                asks = int(self.store.add("asks", 0))
                for ask in range(answered + 1, asks + 1):
                    self.store.set(f"h/{ask}/{self.rank}", self._snapshot())
                answered = asks
        except Exception:  # the store went away (the job is ending): nothing left to watch
            return
        self._stop_main()

    def _stop_main(self) -> None:
        """Raise the verdict in the main thread where it next runs Python and free it from a collective it
        waits in (NCCL's abort does; a gloo wait is not freed). A main thread that has not raised within
        `GRACE` seconds is blocked for good: the verdict is printed and the process ends."""
        verdict, lockstep = self.verdict, self
        if not self._raised:
            log.error("%s", verdict)

            def init(error: BaseException, *args: Any) -> None:
                RankDivergenceError.__init__(error, verdict)
                lockstep._raised = True

            error = type("RankDivergenceError", (RankDivergenceError,), {"__init__": init})
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._main), ctypes.py_object(error))
            self._stop_group()
            deadline = time.monotonic() + GRACE
            while not self._raised and time.monotonic() < deadline:
                time.sleep(POLL / 4)
            if not self._raised:
                self._end("blocked in a collective that the other ranks will not join")
        time.sleep(max(self.timeout, GRACE))  # raised, but the job has not ended (a collective after it?)
        self._end("still running after the error")

    def _end(self, why: str) -> None:
        print(f"[rank {self.rank}] {self.verdict} (this rank was {why}: z3guard ended it)", flush=True)
        os._exit(1)


_FIX = ("ZeRO-3 needs every rank to run the same modules, and read the same parameters across modules, on "
        "every step (so does FSDP). Run the branch on every rank (a dummy input, as LLaVA trainers feed dummy "
        "images), or register a parameter read across modules: deepspeed.zero.register_external_parameter.")


def _first_difference(mine: list, theirs: list, complete: bool) -> tuple | None:
    """(my event, their event or None) where two ranks' events at one boundary part; None while theirs
    are a prefix of mine and they have not passed the boundary (a rank that is behind)."""
    for x, y in zip(mine, theirs):
        if x != y:
            return x, y
    if complete and len(theirs) < len(mine):
        return mine[len(theirs)], None
    return None
