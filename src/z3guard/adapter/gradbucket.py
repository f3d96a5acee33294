"""Each gradient into ZeRO-3's reduce bucket with one stream lookup, not three; out of it in one copy call.

Stage 3 hooks every parameter that needs a gradient. When the gradient arrives, the hook copies it into the
flat bucket that the reduce-scatter reads later, on DeepSpeed's reduce stream: one copy kernel. Around that
kernel, DeepSpeed's `__add_grad_to_ipg_bucket` asks for the current CUDA stream twice without a device
index (each time torch works the device out again), enters and leaves a stream context (a third lookup and
device checks), and runs inside an NVTX wrapper and a `no_grad` decorator. Without offload the backward
waits on the host, not the GPU: on one H200 (GPT-2 medium, 292 parameters) the GPU was busy for 39 ms of a
94 ms backward, and this method was the largest piece of the host's Python time there.

Here the method does the same work in the same order: the reduce stream waits for the current one; on the
reduce stream the gradient is copied into the bucket's next slice and its memory recorded as used there;
the gradient then points at the slice, and the bucket notes the parameter. The current stream is looked up
once, and the switch to the reduce stream and back is the one a stream context makes (`set_stream`). The
same kernels on the same streams in the same order: the same bytes. On the CPU accelerator (no streams)
only the copy and the bookkeeping remain, as in stock. Nothing in it depends on offload (the bucket is on
the device either way), and it was compared with stock on GPUs without offload, with `offload_param` and
with both offloads. It stays off for ZenFlow, on other accelerators, and while a profiler's NVTX tool is
injected (so `nsys` keeps this range). The reduce stream waits on an event kept for the purpose, recorded
on the current stream, where `wait_stream` makes a new event each time: the same wait.

At the bucket's reduce, `partition_grads` copies each parameter's reduced partition into its region of the
flat gradient buffer: one `copy_` per parameter, each a call from Python. Without optimizer offload, at a
micro-step that starts accumulation (no `add_`), the same copies go to torch in one `_foreach_copy_` on the
same stream, after the loop that frees the gradients (the sources are the reduced partitions, which the
list keeps alive). A copy is exact, so the regions hold the same bytes. Accumulating micro-steps and
optimizer offload keep stock's method.
"""
from __future__ import annotations

import contextlib
import os
import types
from typing import Any

import torch

from . import gradbatch
from .leanhooks import NVTX_TOOL

PATCHED = ("_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket", "partition_grads")  # the first name-mangled
_REGIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def _accelerator_kind() -> str | None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    kind = type(get_accelerator())
    return "cuda" if kind is CUDA_Accelerator else "cpu" if kind is CPU_Accelerator else None


def why_off(opt: Any) -> str | None:
    """None where the lean method covers the configuration and was checked against stock in it: the CPU
    accelerator (every offload setting, in CI) and CUDA (no offload, `offload_param`, both offloads).
    Else why stock's method runs."""
    kind = _accelerator_kind()
    if kind is None:
        return "on this accelerator (covered: CUDA's and the CPU's)"
    if getattr(opt, "zenflow", False):
        return "beside ZenFlow's gradient handling"
    if not hasattr(opt, "ipg_buckets"):
        return "without DeepSpeed's reduce buckets (ipg_buckets)"
    if any(os.environ.get(v) for v in NVTX_TOOL):
        return "while a profiler's NVTX tool is injected (DeepSpeed's range around the copy stays)"
    if kind == "cpu":
        return None
    if not isinstance(getattr(opt, "reduce_and_partition_stream", None), torch.cuda.Stream):
        return "without a CUDA reduce stream"
    return None


def apply(opt: Any) -> None:
    lean = _add_on_cuda if _accelerator_kind() == "cuda" else _add_synchronized
    setattr(opt, PATCHED[0], types.MethodType(lean, opt))
    if not getattr(opt, "offload_optimizer", False) and hasattr(torch, "_foreach_copy_"):
        opt.z3guard_stock_partition_grads_on_device = opt.partition_grads
        opt.z3guard_foreach_copies = 0  # bucket reduces whose copies went in one call (tests read it)
        opt.partition_grads = types.MethodType(_partition_grads, opt)


def _add_on_cuda(self: Any, param: Any) -> None:
    current = torch.cuda.current_stream(torch.cuda.current_device())
    reduce = self.reduce_and_partition_stream
    if reduce.device_index != current.device_index:  # a stream context also switches devices: stock's code
        return getattr(type(self), PATCHED[0])(self, param)
    with _no_grad():
        bucket = self.ipg_buckets[self.get_param_comm_dtype(param)]
        grad = param.grad
        fits = self.contiguous_gradients and bucket.elements + grad.numel() <= self.reduce_bucket_size
        if fits and _batched(self, bucket, grad):
            gradbatch.defer(self, param, grad, _slot(bucket, grad), bucket.buffer, current)
            _note(self, bucket, param)
            return
        if gradbatch.active(self):
            gradbatch.flush(self)  # the copies before this one first, as stock orders them
        ready = self.__dict__.get("z3guard_grad_ready")
        if ready is None:
            ready = self.z3guard_grad_ready = torch.cuda.Event()
        ready.record(current)
        reduce.wait_event(ready)
        if fits:
            torch.cuda.set_stream(reduce)
            try:
                slot = _copy_into(bucket, grad)
                grad.record_stream(reduce)  # stock's current stream at this point: the reduce stream
                grad.data = slot
            finally:
                torch.cuda.set_stream(current)
        _note(self, bucket, param)


def _add_synchronized(self: Any, param: Any) -> None:
    with _no_grad():
        bucket = self.ipg_buckets[self.get_param_comm_dtype(param)]
        grad = param.grad
        if self.contiguous_gradients and bucket.elements + grad.numel() <= self.reduce_bucket_size:
            if _batched(self, bucket, grad):
                gradbatch.defer(self, param, grad, _slot(bucket, grad), bucket.buffer)
            else:
                if gradbatch.active(self):
                    gradbatch.flush(self)
                grad.data = _copy_into(bucket, grad)
        _note(self, bucket, param)


def _batched(self: Any, bucket: Any, grad: torch.Tensor) -> bool:
    """Whether this gradient's copy may wait for the batch (gradbatch.py): the bucket's dtype and device."""
    return (gradbatch.active(self) and grad.dtype == bucket.buffer.dtype and grad.device == bucket.buffer.device
            and grad.layout == torch.strided)


def _no_grad() -> Any:
    """Stock's `torch.no_grad()`; a gradient hook runs with grad mode off already (a backward without
    `create_graph`), and then entering and leaving that context, about 5 us a gradient, changes nothing."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}  # shape -> strides of a contiguous view of that shape


def _copy_into(bucket: Any, grad: torch.Tensor) -> torch.Tensor:
    """The gradient copied into the bucket's next slice, on the current stream; returns the slice.

    Stock's slice is `buffer.narrow(0, elements, numel).view_as(grad)`: the contiguous view of the
    gradient's shape at that offset. `as_strided` makes the same view in one call instead of two, with
    the strides `view_as` gave the first time a shape came by."""
    slot = _slot(bucket, grad)
    slot.copy_(grad, non_blocking=True)
    return slot


def _slot(bucket: Any, grad: torch.Tensor) -> torch.Tensor:
    shape, buffer = tuple(grad.shape), bucket.buffer
    strides = _STRIDES.get(shape)
    if strides is None or not buffer.is_contiguous():
        slot = buffer.narrow(0, bucket.elements, grad.numel()).view_as(grad)
        if buffer.is_contiguous():
            _STRIDES[shape] = slot.stride()
        return slot
    return buffer.as_strided(shape, strides, buffer.storage_offset() + bucket.elements)


def _note(self: Any, bucket: Any, param: Any) -> None:
    bucket.params.append(param)
    bucket.process_group = self._get_param_partition_group(param)
    bucket.elements += param.grad.numel()


def _partition_grads(self: Any, params_to_release: list, grad_partitions: list) -> list:
    # DeepSpeed 0.19's `partition_grads` without optimizer offload at micro-step 0, its copies in one call.
    if self.micro_step_id != 0 or self.offload_optimizer or not params_to_release:
        return self.z3guard_stock_partition_grads_on_device(params_to_release, grad_partitions)
    from deepspeed.accelerator import get_accelerator

    self.z3guard_foreach_copies += 1
    regions = getattr(self, _REGIONS)
    rank = self._get_param_partition_rank(params_to_release[0])  # one process group per bucket (stock asserts it)
    stream = None if get_accelerator().is_synchronized_device() else get_accelerator().current_stream()
    buffers, sources = [], []
    for param, grad_partition in zip(params_to_release, grad_partitions):
        if param.partition_numel() * rank >= param.ds_numel:  # an empty partition: nothing to copy
            param.grad = None
            continue
        self._offload_boundary_param_ids.add(param.ds_id)
        buffers.append(regions[param.ds_id].narrow(0, 0, grad_partition.numel()))
        sources.append(grad_partition)
        if stream is not None and param.grad is not None:
            param.grad.record_stream(stream)
        param.grad = None
    if buffers:
        torch._foreach_copy_(buffers, sources, non_blocking=True)
    self._swap_out_offload_fp32_gradients({}, {})
    return buffers
