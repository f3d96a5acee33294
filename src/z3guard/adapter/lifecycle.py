"""How the installed DeepSpeed's ZeRO-3 coordinator lives, read from its code rather than its version.

The crash fix needs to know four things that changed between releases, and each can be seen in the
code itself, so a patch release, a local build or a release we never saw is handled by what it does:

- one coordinator per mode (train/eval), created on first use, up to 0.15.3; one for both from 0.15.4
  (`DeepSpeedZeRoOffload.get_param_coordinator` lost its `training` argument);
- invalidating the trace drains in-flight prefetches itself from 0.15.3 (`_clean_inflight_param_registry`);
  before, the guard has to;
- `fetch_sub_module` takes a `forward` flag from 0.10;
- the in-flight registry is the module's (`ds_inflight_param_registry`, per mode before 0.15.4) from
  0.10; in 0.9 each coordinator keeps its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from .coordinator import DrainingCoordinator, ForwardlessCoordinator, GuardedCoordinator
from .fingerprint import definition, parameters


@dataclass(frozen=True)
class Lifecycle:
    coordinator_per_mode: bool
    invalidation_drains_inflight: bool
    fetch_takes_forward: bool
    registry_on_module: bool

    @property
    def guarded_class(self) -> type[GuardedCoordinator]:
        if not self.fetch_takes_forward:
            return ForwardlessCoordinator
        if not self.invalidation_drains_inflight:
            return DrainingCoordinator
        return GuardedCoordinator

    def describe(self) -> str:
        return ", ".join([
            "a coordinator per mode" if self.coordinator_per_mode else "one coordinator",
            "invalidation drains prefetches" if self.invalidation_drains_inflight else "z3guard drains prefetches",
            "fetch(module, forward)" if self.fetch_takes_forward else "fetch(module)",
            "in-flight registry on the module" if self.registry_on_module else "in-flight registry per coordinator",
        ])


def detect() -> Lifecycle:
    """Read from the source as written: DeepSpeed's decorators (`instrument_w_nvtx`) hide signatures."""
    offload = "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload."
    coordinator = "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator."
    return Lifecycle(
        coordinator_per_mode="training" in parameters(offload + "get_param_coordinator"),
        invalidation_drains_inflight="_clean_inflight_param_registry" in definition(coordinator + "_invalidate_trace")[1],
        fetch_takes_forward="forward" in parameters(coordinator + "fetch_sub_module"),
        registry_on_module="inflight_param_registry" in parameters(coordinator + "__init__"),
    )
