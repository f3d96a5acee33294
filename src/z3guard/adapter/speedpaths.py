"""Which speed paths may run on the installed DeepSpeed: each one's stock code, fingerprinted.

Every speed path is proven bit-identical to the DeepSpeed code it replaces. `STANDS_ON` names that code
(the methods it replaces or re-implements, the calls around them whose order it follows, the kernel
sources it relies on); `VERIFIED` holds the fingerprints (fingerprint.py) of that code on the releases where
its bit-identity tests passed. At install each path's fingerprint is computed from the loaded source: a
match turns it on, anything else (another release, a local patch) keeps that path alone off, with one
line saying why. The crash fix does not depend on any of this.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from . import fingerprint

log = logging.getLogger("z3guard")

S3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
PPC = "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator."
OFFLOAD = "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload."
ADAM = ("deepspeed.ops.adam.cpu_adam:DeepSpeedCPUAdam.step", "deepspeed.ops:/csrc/adam/cpu_adam_impl.cpp",
        "deepspeed.ops:/csrc/includes/cpu_adam.h", "deepspeed.ops:/csrc/includes/simd.h")


@dataclass(frozen=True)
class SpeedPath:
    name: str
    """As `fast_paths` reports it on an engine."""
    option: str
    """The GuardOptions field that turns it off."""
    stands_on: tuple[fingerprint.Target, ...]
    """The stock code its proof of bit-identity is about."""


PATHS: tuple[SpeedPath, ...] = (
    SpeedPath("multi_trace", "fast_paths", tuple(PPC + m for m in (
        "__init__", "_clear_trace_structures", "_invalidate_trace", "trace_prologue", "record_module",
        "reset_step", "fetch_sub_module"))),
    SpeedPath("block_fetch", "fast_block_fetch", (
        OFFLOAD + "__init__", OFFLOAD + "setup_zero_stage3_hooks", OFFLOAD + "_register_deepspeed_module",
        PPC + "fetch_sub_module", PPC + "release_sub_module", "deepspeed.utils.z3_leaf_module:set_z3_leaf_module",
        "deepspeed.utils.z3_leaf_module:z3_leaf_parameter", S3 + "__init__",
        S3 + "create_reduce_and_remove_grad_hooks")),
    SpeedPath("writeback", "fast_writeback", (S3 + "_reassign_or_swap_out_partitioned_parameters", S3 + "step")),
    SpeedPath("fused_step", "fast_fused_step", (S3 + "unscale_and_clip_grads", S3 + "_optimizer_step", S3 + "step",
                                                *ADAM)),
    SpeedPath("grad_offload", "fast_grad_offload", (
        S3 + "partition_grads", S3 + "complete_grad_norm_calculation_for_cpu_offload",
        S3 + "_offload_grad_partition_at_boundary")),
    SpeedPath("grads_cast_on_host", "fast_grad_offload", (
        S3 + "partition_grads", S3 + "_get_fp32_grad_state_partition", S3 + "get_fp32_grad_partitions",
        S3 + "update_fp32_grad_for_param_vectorized", S3 + "finalize_gradient_accumulation_boundary",
        S3 + "_unpin_offload_buffers")),
    SpeedPath("overflow_check", "fast_overflow_check", (
        S3 + "has_overflow", S3 + "_has_inf_or_nan", S3 + "_offload_grad_partition_at_boundary",
        S3 + "partition_grads")),
    SpeedPath("persistent_gather", "fast_persistent_gather", (
        S3 + "_post_step", S3 + "_partition_all_parameters", S3 + "step")),
    SpeedPath("host_threads", "host_threads", ADAM),
    SpeedPath("quiet_modules", "fast_hook_calls", (
        OFFLOAD + "setup_zero_stage3_hooks", OFFLOAD + "_register_deepspeed_module",
        OFFLOAD + "pre_sub_module_forward_function", OFFLOAD + "post_sub_module_forward_function",
        OFFLOAD + "pre_sub_module_backward_function", OFFLOAD + "post_sub_module_backward_function",
        PPC + "fetch_sub_module", PPC + "release_sub_module", PPC + "record_module")),
    SpeedPath("lean_hooks", "fast_hook_calls", (
        "deepspeed.runtime.zero.partition_parameters:print_rank_0", "deepspeed.utils.nvtx:instrument_w_nvtx",
        "deepspeed.accelerator.cuda_accelerator:CUDA_Accelerator.current_stream",
        "deepspeed.runtime.zero.linear:LinearFunctionForZeroStage3.forward", OFFLOAD + "_register_deepspeed_module",
        "deepspeed.runtime.zero.partitioned_param_coordinator:iter_params",
        "deepspeed.runtime.zero.partitioned_param_coordinator:get_all_parameters",
        "deepspeed.runtime.zero.partition_parameters:_init_external_params")),
    SpeedPath("grad_bucket", "fast_hook_calls", (
        S3 + "__add_grad_to_ipg_bucket", S3 + "_get_param_partition_group", S3 + "partition_grads",
        S3 + "__reduce_and_partition_ipg_grads", S3 + "_get_param_partition_rank",
        S3 + "_swap_out_offload_fp32_gradients",
        *(f"deepspeed.accelerator.{m}_accelerator:{m.upper()}_Accelerator.{f}" for m in ("cuda", "cpu")
          for f in ("is_synchronized_device", "resolves_data_dependency", "stream", "current_stream")))),
    SpeedPath("grad_batch", "fast_hook_calls", (  # beside grad_bucket: every reader of the bucket and of its adds
        S3 + "__add_grad_to_ipg_bucket", S3 + "__reduce_and_partition_ipg_grads", S3 + "_pre_step",
        S3 + "reduce_independent_p_g_buckets_and_remove_grads", S3 + "independent_gradient_partition_epilogue",
        S3 + "__avg_scatter_contiguous_grads", S3 + "__avg_scatter_grads", S3 + "offload_states",
        S3 + "reload_states", "deepspeed.runtime.zero.stage3:IPGBucketZ3.clear_params")),
    SpeedPath("grad_norm", "fast_grad_norm", (
        S3 + "get_grad_norm_direct", S3 + "_get_norm_groups", S3 + "_assert_same_partition_group",
        S3 + "_get_param_partition_group", S3 + "_autoep_expert_parallel_group", S3 + "_model_parallel_all_reduce",
        S3 + "__init__")),
)
BY_NAME = {p.name: p for p in PATHS}

# name -> {fingerprint: the releases whose tests passed with that code}. A release whose stock code is the
# same shares the entry; `python -m z3guard.adapter.speedpaths` prints the installed release's fingerprints.
VERIFIED: dict[str, dict[str, tuple[str, ...]]] = {
    "multi_trace": {"bd789db04da32298": ("0.19.8",)},
    "block_fetch": {"aaa5f1ce8d2ab827": ("0.19.8",)},
    "writeback": {"17209b17ba712915": ("0.19.8",)},
    "fused_step": {"f3d307ee9a6e7eed": ("0.19.8",)},
    "grad_offload": {"4048a2eddfab4ed2": ("0.19.8",)},
    "grads_cast_on_host": {"f9e1eedd54ce2dee": ("0.19.8",)},
    "overflow_check": {"37519872ec8c91ed": ("0.19.8",)},
    "persistent_gather": {"e35f20b122fce0ca": ("0.19.8",)},
    "host_threads": {"41e71924906e0aff": ("0.19.8",)},
    "quiet_modules": {"aee9110470da9d39": ("0.19.8",)},
    "lean_hooks": {"958436f127d155ef": ("0.19.5", "0.19.8")},
    "grad_bucket": {"d723790840ad2dc7": ("0.19.5", "0.19.8")},
    "grad_batch": {"c3d31f976066b4e6": ("0.19.8",), "181212aa73ff2c77": ("0.19.5",)},
    "grad_norm": {"ba0108bd6ccb943b": ("0.19.8",), "18f840c9317da3fb": ("0.19.5",)},
}


@functools.cache
def current(name: str) -> str | None:
    """The installed DeepSpeed's fingerprint for path `name`; None where its stock code is missing."""
    try:
        return fingerprint.of(BY_NAME[name].stands_on)
    except Exception:  # a method renamed or gone: that path cannot be proven here
        return None


def why_off(name: str) -> str | None:
    """None if path `name` may run on the installed DeepSpeed, else the reason it may not."""
    found = current(name)
    if found is None:
        return "the DeepSpeed code it replaces is not there"
    if found not in VERIFIED[name]:
        return f"the DeepSpeed code it replaces differs from the code it was verified on (fingerprint {found})"
    return None


def allowed(name: str) -> bool:
    reason = why_off(name)
    if reason is not None:
        say_off(name, f"on this DeepSpeed: {reason}")
    return reason is None


@functools.cache
def say_off(name: str, reason: str, level: int = logging.INFO) -> None:
    """Once per process and reason, on rank 0: a speed path that turned itself off, and why."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        log.log(level, "z3guard: speed path %s off %s; the crash fix and the other paths are unaffected",
                name, reason)


if __name__ == "__main__":
    for path in PATHS:
        print(f"{path.name:20s} {current(path.name)}  {why_off(path.name) or 'verified'}")
