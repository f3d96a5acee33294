"""The host optimizer step behind the next forward (DeepSpeed 0.19, both offloads, with the fused step).

With `offload_param` + `offload_optimizer` the step ends with one pass over the rank's whole fp32 state on
the host (unscale, DeepSpeedCPUAdam, cast into the fp16 partition: 92 ms per rank on GPT-2 medium, bound
by the memory bandwidth both ranks share), and the GPUs wait for all of it before the next forward
fetches its first parameter. Here `step` decides everything a step decides as stock does (overflow, loss
scale, clip factor, the LR and step count the update uses), runs the regions of the persistent parameters
(gathered again at the step's end) and returns; a worker thread runs the rest in partition order, which
is the parameters' registration order. Each gather of parameters waits until their regions are written,
so the next forward starts once its first modules' parameters are ready and overlaps the rest.

Whatever else reads or writes what the pass writes waits for all of it: the next step, the backward's
gradient writes, the optimizer's state_dict/load_state_dict, checkpoint loading, and DeepSpeed's
fp32/gradient accessors (`deepspeed.utils.safe_get_full_fp32_param` & co.). The worker runs one range
at a time with three quarters of the step's OpenMP threads (the rest of the cores run the forward), each
range in C++ without the GIL (nogil.py), so the forward's Python keeps it.

Bit-identical: the same chunks (fusedstep.Update) with the same inputs, each element once; only when.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import logging
import threading
import types
from typing import Any, Iterable

import torch

from . import fusedstep, nogil

log = logging.getLogger("z3guard")

BLOCK = 128  # the Adam kernel's largest SIMD block (fusedstep.py): ranges start on multiples of it
PRIORITY_GAP = 1 << 16  # persistent regions closer than this run as one range
WORKER_RANGE = 1 << 22  # elements per deferred range: the worker takes the GIL once per range

# Stage-3 methods that read or write the fp32 state, gradients or fp16 partitions the pass writes.
BARRIERS = ("state_dict", "load_state_dict", "_offload_grad_partition_at_boundary", "get_full_hp_param",
            "set_full_hp_param", "get_fp32_grad_for_param", "set_fp32_grad_for_param",
            "get_local_fp32_grad_for_param", "set_local_grad_for_param", "get_local_fp32_param",
            "set_local_hp_param", "update_fp32_grad_for_param_vectorized", "get_fp32_grad_partitions",
            "get_lean_optimizer_state", "offload_states", "reload_states", "dump_post_step_gradients",
            "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
            "load_module_checkpoint_state_from_checkpoint_dir_stage3", "_restore_from_bit16_weights",
            "_restore_from_fp32_weights")
PATCHED = BARRIERS


def apply(opt: Any) -> bool:
    """After fusedstep.apply and overflow.apply (whose methods it wraps); False where the kernel cannot run
    without the GIL (the step then stays synchronous)."""
    update = nogil.fused_range(opt.optimizer)
    if update is None:
        return False
    try:
        opt.z3guard_host_step = HostStep(opt, update)
    except ValueError as exc:  # a partition that is not a view of its sub-group's buffer: keep it synchronous
        log.warning("z3guard: the host optimizer step stays synchronous: %s", exc)
        return False
    for name in BARRIERS:
        if hasattr(opt, name):
            setattr(opt, name, _after_host_step(opt.z3guard_host_step, getattr(opt, name)))
    return True


def remove(opt: Any) -> None:
    host_step = vars(opt).get("z3guard_host_step")
    if host_step is not None:
        host_step.wait_all()
        host_step.unhook()


def wait_all(opt: Any) -> None:
    host_step = vars(opt).get("z3guard_host_step")
    if host_step is not None:
        host_step.wait_all()


def close_step(opt: Any) -> None:
    """The step is over: the worker stops once it has run what the step submitted."""
    host_step = vars(opt).get("z3guard_host_step")
    if host_step is not None:
        host_step.close()


def worker_threads(step_threads: int) -> int:
    """The worker's OpenMP threads: three quarters of the step's. The step's count fills the rank's share
    of the cores; beside a running forward (its Python thread, CUDA's and NCCL's helpers) that many
    oversubscribe the cores, and every parallel region of the pass then waits for a descheduled thread
    (b27: the forward beside it took 276-294 ms instead of 135-157)."""
    return max(1, step_threads * 3 // 4)


def _after_host_step(host_step: "HostStep", method):
    def waiting(*args, **kwargs):
        host_step.wait_all()
        return method(*args, **kwargs)

    waiting.__wrapped__ = method
    return waiting


class HostStep:
    """One optimizer's deferred passes: per sub-group, ranges run in order by a worker thread that lives
    for one step's work; fetches wait for their parameters' regions."""

    def __init__(self, opt: Any, fused_range):
        from threadpoolctl import ThreadpoolController

        self.opt, self.fused_range = opt, fused_range
        self.threads = ThreadpoolController()
        self.cond = threading.Condition()
        self.busy = False  # read without the lock on every fetch: set before the worker starts
        self.error: BaseException | None = None
        self.queue: collections.deque = collections.deque()
        self.closed = True
        self.progress: dict[int, tuple[list[int], list[int], list[int]]] = {}  # sub-group -> starts, ends, [done]
        self.stats = {"steps": 0, "deferred_elements": 0, "gather_waits": 0, "barrier_waits": 0}  # waits that blocked
        self.regions = self._regions(opt)  # id(param) -> (sub-group, start, end) in its flat partition
        self.priority = self._priority(opt)  # sub-group -> ranges of its persistent parameters
        self.hooked = self._hook_gathers(opt)

    # -- the step's side --------------------------------------------------------------------
    def submit(self, sub_group_id: int, update: fusedstep.Update) -> None:
        """Within `step` (which waited for the last step's work first); the worker starts at the first."""
        with self.threads.limit(limits=1, user_api="openmp") if self.busy else contextlib.nullcontext():
            for start, end in self.priority.get(sub_group_id, ()):  # one thread beside a running worker
                update.run(start, end, fused_range=self.fused_range)  # the persistent gather reads these
        todo = []
        for start, end in _gaps(self.priority.get(sub_group_id, ()), update.numel):
            todo += [(lo, min(lo + WORKER_RANGE, end)) for lo in range(start, end, WORKER_RANGE)]
        if not todo:
            return
        with self.cond:
            self.progress[sub_group_id] = ([lo for lo, _ in todo], [hi for _, hi in todo], [0])
            self.queue.append((sub_group_id, update, todo, worker_threads(torch.get_num_threads())))
            self.stats["deferred_elements"] += sum(hi - lo for lo, hi in todo)
            if not self.busy:
                self.busy, self.closed, self.error = True, False, None
                self.stats["steps"] += 1
                threading.Thread(target=self._work, name="z3guard-host-step", daemon=True).start()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _work(self) -> None:
        torch.get_num_threads()  # torch's per-thread OpenMP set-up, which would undo the limit below
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed:
                        self.cond.wait()
                    if not self.queue:
                        return
                    sub_group_id, update, todo, threads = self.queue.popleft()
                with self.threads.limit(limits=threads, user_api="openmp"):
                    done = self.progress[sub_group_id][2]
                    for start, end in todo:
                        update.run(start, end, fusedstep.CHUNK_NUMEL, self.fused_range)
                        with self.cond:
                            done[0] += 1
                            self.cond.notify_all()
        except BaseException as exc:  # handed to whoever waits next
            self.error = exc
        finally:
            with self.cond:
                self.busy = False
                self.queue.clear()
                self.cond.notify_all()

    # -- the readers' side ----------------------------------------------------------------
    def wait_all(self) -> None:
        if self.busy:
            with self.cond:
                self.stats["barrier_waits"] += 1
                while self.busy:
                    self.cond.wait()
        self._raise()

    def wait_for(self, params: Iterable) -> None:
        if not self.busy:
            return self._raise()
        need: dict[int, int] = {}  # sub-group -> the last range index that must be done
        for param in params:
            region = self.regions.get(id(param))
            if region is None:
                continue
            sub_group_id, start, end = region
            progress = self.progress.get(sub_group_id)
            if progress is None:
                continue
            last = bisect.bisect_left(progress[0], end) - 1  # the last deferred range starting before `end`
            if last >= 0 and progress[1][last] > start:  # ... overlaps the region (else none does)
                need[sub_group_id] = max(need.get(sub_group_id, -1), last)
        with self.cond:
            if any(self._behind(sg, last) for sg, last in need.items()):
                self.stats["gather_waits"] += 1
                while self.busy and any(self._behind(sg, last) for sg, last in need.items()):
                    self.cond.wait()
        self._raise()

    def _behind(self, sub_group_id: int, last: int) -> bool:
        progress = self.progress.get(sub_group_id)
        return progress is not None and progress[2][0] <= last and self.busy

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"z3guard: the host optimizer step failed on its worker thread: {self.error}") \
                from self.error

    # -- set-up -----------------------------------------------------------------------------
    @staticmethod
    def _regions(opt: Any) -> dict[int, tuple[int, int, int]]:
        regions = {}
        for sub_group_id, params in enumerate(opt.fp16_groups):
            flat = opt.fp16_partitioned_groups_flat[sub_group_id]
            for param in params:
                offset = (param.ds_tensor.data_ptr() - flat.data_ptr()) // flat.element_size()
                if not 0 <= offset <= flat.numel() - param.ds_tensor.numel():
                    raise ValueError(f"{param.ds_summary()}: partition outside its sub-group's flat buffer")
                regions[id(param)] = (sub_group_id, offset, offset + param.ds_tensor.numel())
        return regions

    def _priority(self, opt: Any) -> dict[int, list[tuple[int, int]]]:
        """Per sub-group, the persistent parameters' regions on block boundaries, near ones merged."""
        by_group: dict[int, list[tuple[int, int]]] = {}
        for param in opt.persistent_parameters:
            if id(param) not in self.regions:
                continue
            sub_group_id, start, end = self.regions[id(param)]
            numel = opt.fp16_partitioned_groups_flat[sub_group_id].numel()
            lo, hi = start // BLOCK * BLOCK, min(-(-end // BLOCK) * BLOCK, numel)
            by_group.setdefault(sub_group_id, []).append((lo, hi))
        merged = {}
        for sub_group_id, ranges in by_group.items():
            out: list[list[int]] = []
            for lo, hi in sorted(ranges):
                if out and lo <= out[-1][1] + PRIORITY_GAP:
                    out[-1][1] = max(out[-1][1], hi)
                else:
                    out.append([lo, hi])
            merged[sub_group_id] = [tuple(r) for r in out]
        return merged

    def _hook_gathers(self, opt: Any) -> list:
        """Every gather of these parameters (the coordinator's, GatheredParameters', z3guard's own) goes
        through the parameter's `all_gather_coalesced` or `all_gather`: wait for their regions first."""
        hooked = []
        for params in opt.fp16_groups:
            for param in params:
                coalesced, single = param.all_gather_coalesced, param.all_gather
                param.all_gather_coalesced = self._waiting_coalesced(coalesced)
                param.all_gather = self._waiting_single(param, single)
                hooked.append((param, coalesced, single))
        return hooked

    def _waiting_coalesced(self, gather):
        def all_gather_coalesced(params, *args, **kwargs):
            params = list(params)
            self.wait_for(params)
            return gather(params, *args, **kwargs)
        return all_gather_coalesced

    def _waiting_single(self, param, gather):
        def all_gather(param_list=None, *args, **kwargs):
            self.wait_for([param] if param_list is None else param_list)
            return gather(param_list, *args, **kwargs)
        return all_gather

    def unhook(self) -> None:
        for param, coalesced, single in self.hooked:
            param.all_gather_coalesced, param.all_gather = coalesced, single
        self.hooked = []


def _gaps(ranges: Iterable[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """[0, numel) without `ranges` (sorted, disjoint)."""
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < numel:
        out.append((at, numel))
    return out
