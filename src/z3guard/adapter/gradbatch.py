"""Gradients into ZeRO-3's reduce bucket a block at a time: one copy call for many gradients.

Beside `grad_bucket` (gradbucket.py). Stage 3's gradient hook copies each gradient into the flat reduce
bucket as it arrives: per gradient a wait of the reduce stream on the current one, two stream switches, one
copy kernel and its launch. Without offload the backward waits on the host (on one H100, GPT-2 medium:
292 gradients, the GPU busy for 46 of 110 ms), and each of those per-gradient steps is host time.

Here the hook does the bookkeeping at once, as stock does (the bucket's element count and parameter list,
so every decision about when to reduce is stock's), and notes where the gradient goes. The copies wait
until something needs the bucket, then run in one `_foreach_copy_` on the reduce stream after one wait on
the stream that produced them; each gradient then points at its slice, as stock leaves it. Until then
`param.grad` is the gradient autograd produced, with stock's values: a reader sees what stock shows, and a
second accumulation into it (autograd adds in place with grad mode off) is what stock's slice would have
held. The copy's source is that tensor, as stock's was, whatever `param.grad` was set to meanwhile.

The pending copies run before:
- the bucket's reduce (`__reduce_and_partition_ipg_grads`: the only reader of the bucket, also at the
  backward's end) and the step's start (`_pre_step`, where stock drops what a phase left in the buckets);
- a second gradient of a parameter still pending, or a gradient on another stream;
- `PENDING_ELEMENTS` pending (memory: the gradients not yet copied are held a little longer than stock
  holds them, at most this many elements).
A copy is exact and the slices are disjoint, so the bucket holds the same bytes in the same places when
it is reduced. The pending copies into a bucket buffer that went away (`offload_states`) are dropped: stock's
copies went to a buffer nothing reads again. Only gradients of the bucket's dtype and device wait: the
other copies (a cast) run at once, after the pending ones, as stock's do.
"""
from __future__ import annotations

import types
from typing import Any

import torch

PATCHED = ("_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", "_pre_step")  # flush first
PENDING_ELEMENTS = 1 << 24  # 32 MiB of bf16 gradients: a GPT-2-medium block (12.6M) fits, a 70B block splits
_PENDING = "z3guard_pending_grads"  # [(the gradient as autograd left it, its slice, the bucket's buffer)]


def apply(opt: Any) -> None:
    """After gradbucket.apply, whose add methods call `defer`."""
    opt.z3guard_batched = {"flushes": 0, "copies": 0}  # tests read these
    setattr(opt, _PENDING, [])
    opt.z3guard_pending_elements = 0
    opt.z3guard_pending_stream = None
    opt.z3guard_pending_ids = set()
    for name in PATCHED:
        stock = getattr(opt, name)

        def flushed_first(*args, _stock=stock, **kwargs):
            flush(opt)
            return _stock(*args, **kwargs)

        setattr(opt, name, flushed_first)


def active(opt: Any) -> bool:
    return _PENDING in vars(opt)


def defer(opt: Any, param: Any, grad: torch.Tensor, slot: torch.Tensor, buffer: torch.Tensor,
          stream: Any = None) -> None:
    """Note `grad`'s copy into `slot` (a slice of `buffer`) for the next flush; `stream` made it (CUDA)."""
    pending = getattr(opt, _PENDING)
    if pending and (stream != opt.z3guard_pending_stream or id(param) in opt.z3guard_pending_ids
                    or opt.z3guard_pending_elements + grad.numel() > PENDING_ELEMENTS):
        flush(opt)
    pending.append((grad, slot, buffer))
    opt.z3guard_pending_ids.add(id(param))
    opt.z3guard_pending_elements += grad.numel()
    opt.z3guard_pending_stream = stream


def flush(opt: Any) -> None:
    """The pending copies, in one call; then each gradient points at its slice."""
    pending = getattr(opt, _PENDING)
    if not pending:
        return
    stream = opt.z3guard_pending_stream
    buffers = [b.buffer for b in opt.ipg_buckets.values()]
    live = [(g, s) for g, s, buffer in pending if any(buffer is b for b in buffers)]
    pending.clear()
    opt.z3guard_pending_ids.clear()
    opt.z3guard_pending_elements = 0
    opt.z3guard_pending_stream = None
    if not live:
        return
    grads, slots = [g for g, _ in live], [s for _, s in live]
    with torch.no_grad():
        if stream is None:  # the CPU accelerator: no streams
            torch._foreach_copy_(slots, grads)
        else:
            reduce = opt.reduce_and_partition_stream
            ready = opt.__dict__.get("z3guard_grad_ready")
            if ready is None:
                ready = opt.z3guard_grad_ready = torch.cuda.Event()
            ready.record(stream)
            reduce.wait_event(ready)
            current = torch.cuda.current_stream(reduce.device_index)
            torch.cuda.set_stream(reduce)
            try:
                torch._foreach_copy_(slots, grads, non_blocking=True)
                for g in grads:
                    g.record_stream(reduce)
            finally:
                torch.cuda.set_stream(current)
        for g, s in zip(grads, slots):
            g.data = s
    opt.z3guard_batched["flushes"] += 1
    opt.z3guard_batched["copies"] += len(live)


def flush_if_active(opt: Any) -> None:
    if active(opt):
        flush(opt)
