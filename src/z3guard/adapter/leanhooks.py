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

None of these touches a tensor, and the order of the calls around them is unchanged. The results are the
same bits by construction, and the fast-path tests run with this path on. `remove()` restores all three.
"""
from __future__ import annotations

import os
import sys
import types
from typing import Any, Callable

import torch

NVTX_TOOL = ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")
_PARTITIONER = "deepspeed.runtime.zero.partition_parameters"
_undo: list[Callable[[], None]] = []


def apply() -> None:
    """Make the three lookups cheap, once per process (idempotent)."""
    if _undo:
        return
    try:
        _lean_print_rank_0()
        _lean_nvtx()
        _lean_current_stream()
    except BaseException:
        remove()
        raise


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
