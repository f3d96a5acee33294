"""The self-check run before anything is patched: is every DeepSpeed internal the crash fix touches there,
in the shape it expects? A release that passes is guarded whatever its version string says; one that fails
is not touched at all (install() then warns, or raises under strict)."""
from __future__ import annotations

import inspect
from typing import Callable

# Private state of the coordinator that the guard reads or sets (name-mangled, set in __init__ or
# _clear_trace_structures / reset_step).
COORDINATOR_STATE = ("submodule_order", "param_order", "step_id", "param_queue", "inflight_param_registry",
                     "most_recent_step_id_param_fetched_for", "step_id_module_fetched_for", "trace_mode")
COORDINATOR_METHODS = ("reset_step", "trace_prologue", "fetch_sub_module", "is_complete_trace", "_invalidate_trace",
                       "record_module", "release_sub_module")


def problems() -> list[str]:
    """What the installed DeepSpeed lacks for the crash fix; empty when everything is in place."""
    found: list[str] = []
    for name, check in CHECKS:
        try:
            missing = check()
        except Exception as exc:  # an import or attribute error is itself the finding
            missing = f"{type(exc).__name__}: {exc}"
        if missing:
            found.append(f"{name}: {missing}")
    return found


def _reads() -> str | None:
    from deepspeed.runtime.zero import parameter_offload as po

    if not isinstance(getattr(po, "FWD_MODULE_STACK", None), list):
        return "parameter_offload.FWD_MODULE_STACK is not a list"
    cls = po.ZeROOrderedDict
    init = inspect.getsource(cls.__init__)
    for attr in ("_parent_module", "_in_forward"):
        if attr not in init:
            return f"ZeROOrderedDict.__init__ no longer sets {attr}"
    if "__getitem__" not in vars(cls):
        return "ZeROOrderedDict has no __getitem__ of its own"
    return None


def _params() -> str | None:
    from deepspeed.runtime.zero import partition_parameters as pp

    absent = [s for s in ("NOT_AVAILABLE", "INFLIGHT", "AVAILABLE") if not hasattr(pp.ZeroParamStatus, s)]
    if absent:
        return f"ZeroParamStatus lacks {', '.join(absent)}"
    if not callable(getattr(pp, "register_external_parameter", None)):
        return "register_external_parameter is gone"
    return None


def _coordinator() -> str | None:
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC
    from deepspeed.runtime.zero.partitioned_param_coordinator import ZeRoTraceMode, iter_params  # noqa: F401

    absent = [m for m in COORDINATOR_METHODS if not callable(getattr(PPC, m, None))]
    if absent:
        return f"PartitionedParameterCoordinator lacks {', '.join(absent)}"
    source = "".join(inspect.getsource(getattr(PPC, m)) for m in ("__init__", "_clear_trace_structures", "reset_step")
                     if hasattr(PPC, m))
    unset = [s for s in COORDINATOR_STATE if f"self.__{s}" not in source]
    if unset:
        return f"PartitionedParameterCoordinator no longer keeps {', '.join(unset)}"
    if not hasattr(ZeRoTraceMode, "RECORD"):
        return "ZeRoTraceMode.RECORD is gone"
    if "tracing error" not in inspect.getsource(inspect.getmodule(PPC)):
        return "the coordinator no longer raises a 'tracing error'"
    return None


def _offload() -> str | None:
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    for m in ("get_param_coordinator", "mark_persistent_parameters"):
        if not callable(getattr(DeepSpeedZeRoOffload, m, None)):
            return f"DeepSpeedZeRoOffload lacks {m}"
    if "persistent_parameters" not in inspect.getsource(DeepSpeedZeRoOffload.mark_persistent_parameters):
        return "DeepSpeedZeRoOffload no longer keeps persistent_parameters"
    return None


def _engine() -> str | None:
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not callable(getattr(deepspeed, "initialize", None)):
        return "deepspeed.initialize is gone"
    for method, wanted in (("save_checkpoint", ("save_dir", "tag", "client_state")),
                           ("load_checkpoint", ("load_dir", "tag"))):
        fn = getattr(DeepSpeedEngine, method, None)
        if fn is None:
            return f"DeepSpeedEngine.{method} is gone"
        names = list(inspect.signature(fn).parameters)
        if names[1:1 + len(wanted)] != list(wanted):
            return f"DeepSpeedEngine.{method} takes {names[1:]}, expected {list(wanted)} first"
    return None


CHECKS: tuple[tuple[str, Callable[[], str | None]], ...] = (
    ("cross-module reads", _reads), ("parameter states", _params), ("coordinator", _coordinator),
    ("parameter offload", _offload), ("engine", _engine))
