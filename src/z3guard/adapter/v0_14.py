"""Adapter for DeepSpeed 0.14 (tested and supported: 0.14.4): a coordinator per mode (train/eval), created on
first use; the training one is reset at the end of backward. Its trace invalidation leaves in-flight
prefetches behind (and reset_step then refuses to run), so the guarded class releases them."""
from __future__ import annotations

from typing import Any

from torch import nn

from .common import P, GuardedCoordinator, ZeroAdapter


class GuardedCoordinator14(GuardedCoordinator):
    multi_trace = False  # trace switching is checked on 0.19 only; here a departure re-records as stock does
    def _invalidate_trace(self) -> None:
        super()._invalidate_trace()
        registry = getattr(self, P + "inflight_param_registry")
        release = getattr(self, P + "release_param")
        for param, handle in list(registry.items()):
            handle.wait()
            del registry[param]
            release(param)  # partitions it unless a running module still holds it


class V0_14(ZeroAdapter):
    guarded_class = GuardedCoordinator14

    def coordinators(self, engine: Any) -> list:
        offload = self.offload(engine)
        return [offload.get_param_coordinator(training=mode) for mode in (True, False)]

    def inflight_registries(self, engine: Any) -> list[dict]:
        return list(engine.module.ds_inflight_param_registry.values())

    def gather(self, params: list[nn.Parameter]) -> None:
        """One parameter per all-gather on CPU: 0.14's coalesced gather waits for the last of its
        all-gathers only, and on gloo, where its closing synchronize does nothing, the others may still
        be writing (0.19 waits for each). A single parameter's gather blocks until it is done."""
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            return super().gather(params)
        for param in params:
            param.all_gather(param_list=[param])


ADAPTER = V0_14()
