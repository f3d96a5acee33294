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

- The parameters of a module, which ZeRO-3's coordinator lists (`iter_params`) at every fetch and release,
  about 110 times per step on a 24-layer model, recursively for a block fetched whole. Stock goes through
  `named_parameters`, which builds a name for every module and parameter it passes. Here the same
  parameters in the same order (modules depth-first in registration order, each module and parameter
  once, then the module's external parameters) are read from the modules' dicts. Stock's function runs
  under `torch.compile`, for modules that list their members their own way, and while a profiler's NVTX
  tool is injected. (z3guard's own wait for a parameter in flight, on reads of another module's
  parameters, stays on `named_parameters`: it is for a model's reads, and these are ZeRO-3's.)

None of these touches a tensor, and the order of the calls around them is unchanged. The results are the
same bits by construction, and the fast-path tests run with this path on. `remove()` restores all five.
"""
from __future__ import annotations

import collections
import functools
import inspect
import os
import sys
import types
from typing import Any, Callable, Iterator

import torch

NVTX_TOOL = ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")
# torch.compiler.is_compiling arrived in torch 2.3; before it, torch._dynamo's
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
_PARTITIONER = "deepspeed.runtime.zero.partition_parameters"
_COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"
_undo: list[Callable[[], None]] = []


def apply() -> None:
    """Make the lookups cheap, once per process (idempotent)."""
    if _undo:
        return
    try:
        _lean_print_rank_0()
        _lean_nvtx()
        _lean_current_stream()
        _lean_iter_params()
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

    _replace_everywhere("print_rank_0", stock, print_rank_0)


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


def module_parameters(module: Any, recurse: bool = False) -> list | None:
    """What `named_parameters(recurse=recurse)` yields, without the names: the modules depth-first in the
    order they were registered, each once, and each one's parameters in order, each parameter once. None
    where a module lists them its own way (a class or an instance with its own listing methods, a
    container that is not a dict): then only its own code says what it yields."""
    modules = _modules_in_order(module) if recurse else ([module] if _plain(module) else None)
    if modules is None:
        return None
    found: list = []
    seen: set[int] = set()
    for m in modules:
        values = _values(m._parameters)
        if values is None:
            return None
        for p in values:
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                found.append(p)
    return found


def _modules_in_order(module: Any) -> list | None:
    """`module.modules()`: pre-order, children in registration order, each module once."""
    found, todo, seen = [], [module], set()
    while todo:
        m = todo.pop()
        if id(m) not in seen:
            children = _values(m._modules) if _plain(m) else None
            if children is None:
                return None
            seen.add(id(m))
            found.append(m)
            todo.extend(c for c in reversed(children) if c is not None)
    return found


def _values(members: Any) -> Any:
    """A module's `_parameters` or `_modules` values in the order `.items()` gives them, read without the
    container's own item hooks (a plain read, as `dict.values` is); None for another kind of container."""
    if type(members) is dict:
        return dict.values(members)
    if isinstance(members, collections.OrderedDict) and type(members).values is collections.OrderedDict.values:
        return collections.OrderedDict.values(members)  # the linked order `items()` follows
    return None


def _plain(module: Any) -> bool:
    """Whether `module` lists its modules and parameters with torch's own methods, and is told apart from
    other modules by identity (as `named_modules`' memo does for torch's own `Module`)."""
    return _plain_class(type(module)) and not ("named_modules" in module.__dict__
                                               or "named_parameters" in module.__dict__)


@functools.cache
def _plain_class(cls: type) -> bool:
    return all(getattr(cls, name) is getattr(torch.nn.Module, name) for name in (
        "named_parameters", "named_modules", "_named_members", "parameters", "modules", "__hash__", "__eq__"))


def _lean_iter_params() -> None:
    import importlib

    if any(os.environ.get(v) for v in NVTX_TOOL):
        return  # a profiler listens: stock's listing keeps its NVTX range
    coordinator = importlib.import_module(_COORDINATOR)
    stock = coordinator.iter_params

    def iter_params(module: Any, recurse: bool = False) -> Any:
        if is_compiling():
            return stock(module, recurse)
        params = module_parameters(module, recurse)
        if params is None:
            return stock(module, recurse)
        params.extend(p for _, p in module.ds_external_parameters())
        return params

    _replace_everywhere("iter_params", stock, iter_params)


def _replace_everywhere(name: str, stock: Callable, lean: Callable) -> None:
    """`lean` for `stock` in every module that holds it under `name`: its own and those that imported it
    (module dicts read directly: no lazy module's __getattr__). `remove()` puts `stock` back."""
    holders = [m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get(name) is stock]
    for module in holders:
        setattr(module, name, lean)

    def restore() -> None:
        for module in holders:
            setattr(module, name, stock)

    _undo.append(restore)
