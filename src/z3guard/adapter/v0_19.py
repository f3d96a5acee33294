"""Adapter for DeepSpeed 0.19 (tested and supported: 0.19.8): one coordinator for train and eval (since 0.15.4),
reset from the root module's forward pre-hook; invalidation releases in-flight prefetches itself."""
from __future__ import annotations

from typing import Any

from . import blockfetch, fastpaths
from .common import ZeroAdapter


class V0_19(ZeroAdapter):
    fetches_blocks = True

    def coordinators(self, engine: Any) -> list:
        return [self.offload(engine).get_param_coordinator()]

    def inflight_registries(self, engine: Any) -> list[dict]:
        return [engine.module.ds_inflight_param_registry]

    def apply_fast_paths(self, engine: Any, options: Any) -> list[str]:
        blocks = blockfetch.marked(engine.module)  # fetched whole since the engine was built
        applied = [f"block_fetch={blocks}"] if blocks else []
        if engine.optimizer is None or not hasattr(engine.optimizer, "parameter_offload"):
            return applied
        return applied + fastpaths.apply(engine, options.fast_writeback, options.fast_overflow_check,
                                         options.host_threads, options.fast_persistent_gather,
                                         options.fast_fused_step, options.fast_grad_offload)

    def remove_fast_paths(self, engine: Any) -> None:
        if engine.optimizer is not None and hasattr(engine.optimizer, "parameter_offload"):
            fastpaths.remove(engine)


ADAPTER = V0_19()
