"""User-facing options, each with the reason it exists."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class GuardOptions:
    warn: bool = True
    """Log one warning per distinct trace divergence (rank 0). Records are kept either way; turn the
    warnings off where a dynamic model diverges by design and the summary is enough."""

    fast_writeback: bool = True
    """With `offload_param`: cast the updated fp32 partition to fp16/bf16 on the device and copy it into
    the pinned buffer in chunks, instead of DeepSpeed's copy that builds a pageable fp32 host temporary
    of the whole partition every step. Bit-identical (same rounding); off only to compare with stock."""

    fast_overflow_check: bool = True
    """With `offload_optimizer` and fp16: decide the overflow check from the gradient norms stage 3 took
    on the device as each gradient reached the host buffer (a norm is finite exactly when its elements
    are); read only what no current norm covers, on the GPU from pinned memory or from one fp32 sum with
    the exact check only when the sum is not finite; instead of two full-size boolean temporaries on one
    thread. The same decision every time; off only to compare with stock."""

    fast_persistent_gather: bool = True
    """Keep persistent parameters (biases, norms) gathered through the optimizer step instead of
    releasing them one by one at its start, and refresh them after an applied step with one collective
    instead of one per parameter. Same bytes; off only to compare with stock."""

    fast_fused_step: bool = True
    """With `offload_param` + `offload_optimizer` and DeepSpeedCPUAdam (and `fast_writeback`): unscale,
    Adam and the write-back cast run chunk by chunk in one pass over the host state instead of three
    passes over all of it. Bit-identical (chunks on the Adam kernel's SIMD blocks). Steps aside, per
    step, where optimizer step hooks are registered; off only to compare with stock."""

    fast_grad_offload: bool = True
    """With `offload_optimizer`: in the backward, take each gradient's norm and fp32 cast from the partition
    still on the device instead of copying it back from the host buffer it was just copied into; at the
    step, add up the per-parameter norms on the host in stock's order, after one read. Beside the fused
    step, the fp32 gradients are not copied to the host at all: the fused step casts them from the fp16
    copy there (an exact cast), and DeepSpeed's gradient accessors get them written first. Same bytes (the
    same IEEE operations in the same order); off only to compare with stock."""

    fast_block_fetch: bool = True
    """Fetch each repeated block (a transformer's layers) whole, as one ZeRO-3 leaf module, instead of
    module by module through hooks that cost more than the copies at transformer sizes. Applies to the
    engines built after `install()` (an existing engine's hooks are set already), on DeepSpeed 0.19; never
    where the model has a leaf module or a granularity threshold of the user's. Bit-identical (the same
    sums, each gradient reduced once); off to keep DeepSpeed's per-module fetch. See adapter/blockfetch.py."""

    host_threads: int | None = None
    """With `offload_optimizer` and DeepSpeedCPUAdam: OpenMP threads for the optimizer step. `None`
    (auto) replaces only torchrun's default of one thread per rank (OMP_NUM_THREADS=1 that the user did
    not set) by the rank's share of the cores; 0 turns it off; a number sets it. Bit-identical for any
    count: what runs in the step does not depend on it (see adapter/fastpaths.py)."""

    def __post_init__(self) -> None:
        """A wrong type would be read the wrong way much later ("no" is true, "8" fails deep inside an
        engine's start): refuse it here, by name."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "host_threads":
                if value is not None and (type(value) is not int or value < 0):
                    raise ValueError(f"GuardOptions.host_threads: expected None (auto), 0 (off) or a positive "
                                     f"number of threads, got {value!r}")
            elif type(value) is not bool:
                raise ValueError(f"GuardOptions.{f.name}: expected True or False, got {value!r}")
