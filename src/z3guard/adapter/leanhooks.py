"""Cheaper bookkeeping inside ZeRO-3's module hooks, which run about a thousand times per step.

Without offload, a ZeRO-3 step on one GPU waits on the host, not the device. A GPT-2-medium step on one
H200 spends about 75 ms in kernels and about 270 ms in total. Three lookups inside DeepSpeed's hooks cost
more than the work they frame:

- `get_accelerator().current_stream()` with no device index, about 2,500 calls per step. Each call makes
  torch work out the device type again (`torch.cuda.is_available()`, which reads the environment) before it
  asks for the current device. Here the current device's index is passed instead: the same stream object.
- NVTX ranges around every hook, about 5,000 push/pop pairs per step, each with a `torch.compile` check.
  They reach no one unless a profiler injected an NVTX tool. This path turns them off only while no such
  tool is injected (`NVTX_INJECTION64_PATH` unset), so `nsys` still sees DeepSpeed's ranges.
- `print_rank_0` in the parameter partitioner, about 1,700 calls per step. It queries the rank before it
  checks whether printing was asked for, and it never is. Here the check comes first.
- The signature of an autograd Function's `forward`, about 700 times per forward on a 24-layer Llama.
  Where a Function defines `setup_context`, as DeepSpeed's memory-efficient linear and its per-module
  backward hooks do, torch's `Function.apply` binds the arguments to `inspect.signature(forward)` on every
  call, and `inspect` rebuilds that signature from the code each time unless the function carries it
  (`__signature__`). Here those functions carry it, computed once by `inspect` itself.

None of these touches a tensor, and the order of the calls around them is unchanged. The results are the
same bits by construction, and the fast-path tests run with this path on. `remove()` restores all four.
"""
from __future__ import annotations

import inspect
import os
import sys
import types
from typing import Any, Callable, Iterator

import torch

NVTX_TOOL = ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")
_PARTITIONER = "deepspeed.runtime.zero.partition_parameters"
_undo: list[Callable[[], None]] = []


def apply() -> None:
    """Make the lookups cheap, once per process (idempotent)."""
    if _undo:
        return
    try:
        _lean_print_rank_0()
        _lean_nvtx()
        _lean_current_stream()
        from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

        presign(LinearFunctionForZeroStage3)
    except BaseException:
        remove()
        raise


def module_hook_functions(root: Any) -> Iterator[type]:
    """The autograd Functions ZeRO-3 made for the modules under `root`: one class per module and backward
    hook, made when the engine registered its hooks."""
    for module in root.modules():
        for name in ("pre_bwd_fn", "post_bwd_fn"):
            function = vars(module).get(name)
            if isinstance(function, type) and issubclass(function, torch.autograd.Function):
                yield function


def presign_module_hooks(root: Any) -> int:
    """`presign` the Functions of `module_hook_functions(root)`; returns how many it set."""
    return sum(presign(function) for function in module_hook_functions(root))


def presign(function: type) -> bool:
    """Give `function.forward` its own signature, where torch would rebuild it on every call (a Function
    with `setup_context`); True if it was set here. The signature is the one `inspect` computes."""
    forward = vars(function).get("forward")
    forward = forward.__func__ if isinstance(forward, staticmethod) else None
    if (not isinstance(forward, types.FunctionType) or "__signature__" in vars(forward)
            or "setup_context" not in vars(function)):
        return False
    forward.__signature__ = inspect.signature(forward)
    _undo.append(lambda: vars(forward).pop("__signature__", None))
    return True


def remove() -> None:
    while _undo:
        _undo.pop()()


def _lean_print_rank_0() -> None:
    stock = sys.modules[_PARTITIONER].print_rank_0

    def print_rank_0(message: Any, debug: bool = False, force: bool = False) -> None:
        if debug or force:  # stock prints on rank 0 only when one of them is set
            stock(message, debug=debug, force=force)

    # its `import *` importers hold the same function (module dicts read directly: no lazy module's __getattr__)
    holders = [m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get("print_rank_0") is stock]
    for module in holders:
        module.print_rank_0 = print_rank_0

    def restore() -> None:
        for module in holders:
            module.print_rank_0 = stock

    _undo.append(restore)


def _lean_nvtx() -> None:
    from deepspeed.utils import nvtx

    if any(os.environ.get(v) for v in NVTX_TOOL) or not nvtx.enable_nvtx:
        return
    nvtx.enable_nvtx = False
    _undo.append(lambda: setattr(nvtx, "enable_nvtx", True))


def _lean_current_stream() -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    accelerator = get_accelerator()
    if type(accelerator) is not CUDA_Accelerator or "current_stream" in vars(accelerator):
        return

    def current_stream(self: Any, device_index: Any = None) -> Any:
        return torch.cuda.current_stream(torch.cuda.current_device() if device_index is None else device_index)

    accelerator.current_stream = types.MethodType(current_stream, accelerator)
    _undo.append(lambda: vars(accelerator).pop("current_stream", None))
