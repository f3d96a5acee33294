"""User-facing options, each with the reason it exists."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class GuardOptions:
    warn: bool = True
    """Log one warning per distinct trace divergence (rank 0). Records are kept either way; turn the
    warnings off where a dynamic model diverges by design and the summary is enough."""

    fast_paths: bool = True
    """All speed paths at once. False keeps only the crash fix and the checkpoint guard: DeepSpeed's own
    code runs everywhere else (each `fast_*` below then has no effect). The switch to reach for first
    when something looks wrong."""

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

    fast_hook_calls: bool = True
    """Fewer and cheaper ZeRO-3 module hooks. The hooks run about a thousand times per step, and without
    offload the step waits on them. Modules with no parameter below them (activations, dropout) get none
    (engines built after `install()`; adapter/quietmodules.py), and five lookups inside the others are
    made cheap: the current CUDA stream, NVTX ranges that no profiler receives (left on where one is
    injected, as under nsys), a debug print's rank query, the signature torch binds each call of
    DeepSpeed's autograd Functions to, and a module's parameter list (adapter/leanhooks.py). Each
    gradient's copy into the reduce bucket, one per parameter per step, looks the stream up once and
    makes its slice in one call, and without optimizer offload the copies out of
    the bucket into the gradient partitions go to torch in one call (adapter/gradbucket.py). The same
    copies and collectives with the same contents; off only to compare with stock."""

    fast_grad_norm: bool = True
    """Without `offload_optimizer`, on CUDA: the optimizer step's per-gradient fp64 norms (a cast and a
    reduction for each parameter, which the GPU otherwise waits on the host to launch) of the gradients
    under 1M elements are recorded once into a CUDA graph and replayed each step. The same kernels on the
    same inputs; off only to compare with stock. See adapter/gradnorm.py."""

    fast_block_fetch: bool = True
    """Fetch each repeated block (a transformer's layers) whole, as one ZeRO-3 leaf module, instead of
    module by module through hooks that cost more than the copies at transformer sizes (both offloads on
    2 x H200: 480 -> 321-343 ms). Each gradient still goes through stock's per-parameter reduction, in
    stock's order, so the results are stock's bits (tested at 2, 3 and 4 ranks, with parameters unused on
    some steps). Only blocks no larger than the model's largest module (the most stock gathers at once); never
    with NVMe parameter offload, a leaf module or a granularity threshold of the user's. Applies to
    engines built after `install()`. See adapter/blockfetch.py."""

    durable_saves: bool = False
    """Make `save_checkpoint` return only once its files are on disk: fsync before the rename that
    publishes it and before `latest` moves, so that it survives a power loss or a machine crash right
    after the call. Off (default), a save is published as soon as every rank's bytes are written and
    hashed, as stock's save returns with its bytes in the page cache; the disk write-back then finishes
    on a thread of its own while training goes on, a process that exits waits for it, and the next save
    raises on every rank if the disk reported an error. A process that dies loses nothing either way; a
    machine crash during those seconds can leave the newest checkpoint torn, which the load's
    verification names (load the one before). Costs the disk's write time on each save."""

    strict: bool = False
    """Raise where z3guard cannot guard (a DeepSpeed whose internals fail the self-check, a guard that fails
    to apply) instead of warning once and letting stock DeepSpeed run. For users who would rather stop
    than train unguarded."""

    lockstep_timeout: float = 600.0
    """Seconds a rank waits for the others at a point where it checks that all run the same module (a
    recording step, an order change, a first read of a partitioned parameter). Ranks that are seen to
    run different modules stop at once, all with one error naming the module; this bounds the wait for
    a rank that never gets there. The default is NCCL's own collective timeout: never less patient
    than stock."""

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
            elif f.name == "lockstep_timeout":
                if type(value) not in (int, float) or not value > 0:
                    raise ValueError(f"GuardOptions.lockstep_timeout: expected a positive number of seconds, "
                                     f"got {value!r}")
            elif type(value) is not bool:
                raise ValueError(f"GuardOptions.{f.name}: expected True or False, got {value!r}")


TRUE = ("1", "on", "true", "yes")
FALSE = ("0", "off", "false", "no")


def from_environment(text: str) -> GuardOptions:
    """GuardOptions from `Z3GUARD_OPTIONS`'s form: comma-separated `field=value`, e.g.
    "fast_paths=off,host_threads=8". Booleans take on/off, true/false, yes/no, 1/0; host_threads takes
    auto, off or a number. Refuses an unknown field or a bad value by name, with what is allowed."""
    known = {f.name: f for f in fields(GuardOptions)}
    values: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = (x.strip() for x in item.partition("="))
        if name not in known:
            raise ValueError(f"Z3GUARD_OPTIONS: unknown option {name!r}; options: {', '.join(known)}")
        if not sep:
            raise ValueError(f"Z3GUARD_OPTIONS: {name!r} has no value; write {name}=<value>")
        values[name] = _parse(name, raw.lower())
    return GuardOptions(**values)


def _parse(name: str, raw: str) -> object:
    if name == "host_threads":
        if raw in ("auto", "none", ""):
            return None
        if raw in FALSE:
            return 0
        if raw.isdigit():
            return int(raw)
        raise ValueError(f"Z3GUARD_OPTIONS: host_threads={raw!r}; expected auto, off or a number of threads")
    if name == "lockstep_timeout":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"Z3GUARD_OPTIONS: lockstep_timeout={raw!r}; expected a number of seconds") from None
    if raw in TRUE:
        return True
    if raw in FALSE:
        return False
    raise ValueError(f"Z3GUARD_OPTIONS: {name}={raw!r}; expected one of {', '.join(TRUE + FALSE)}")
