"""Adapter for DeepSpeed 0.9 (tested and supported: 0.9.1, the report's release; on GPUs only, since 0.9 ships no
CPU accelerator): like 0.14 (a coordinator per mode, invalidation that leaves in-flight prefetches
behind), but `fetch_sub_module` takes no `forward` flag and each coordinator keeps its own in-flight
registry."""
from __future__ import annotations

from typing import Any

from torch import nn

from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

from .common import P
from .v0_14 import GuardedCoordinator14, V0_14


class GuardedCoordinator9(GuardedCoordinator14):
    def fetch_sub_module(self, current_submodule: nn.Module, forward: bool = True) -> None:
        super().fetch_sub_module(current_submodule, forward)

    def _stock_fetch(self, module: nn.Module, forward: bool) -> None:
        PartitionedParameterCoordinator.fetch_sub_module(self, module)


class V0_9(V0_14):
    guarded_class = GuardedCoordinator9

    def inflight_registries(self, engine: Any) -> list[dict]:
        return [getattr(c, P + "inflight_param_registry") for c in self.coordinators(engine)]


ADAPTER = V0_9()
