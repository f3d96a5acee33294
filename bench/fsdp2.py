"""PyTorch FSDP2 (`fully_shard`) on the benchmark models: the baseline outside DeepSpeed, on the same
model, seed, batches and timing as worker.py's DeepSpeed runs (worker.run_fsdp2 measures it).

bf16 parameters with fp32 gradient reduction (MixedPrecisionPolicy), AdamW (fused on GPUs), gradients
clipped at 1.0 as the DeepSpeed runs' `gradient_clipping`. Offload: `param+optimizer` is FSDP2's
CPUOffloadPolicy, which moves parameters, gradients and the optimizer step to the host together; FSDP2
has no parameter-only offload, so `param` is refused (bench/run.py skips it with a note). The offloaded
step is torch's AdamW on the host, on the rank's torch threads: torchrun's 1, or its share of the cores
in fsdp2-tuned.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import models

OFFLOADED = {"none": None, "param+optimizer": "parameters, gradients and optimizer step (CPUOffloadPolicy)"}


def check_offload(offload: str) -> None:
    """Refuse the offload settings FSDP2 has no counterpart for, naming the one it has."""
    if offload not in OFFLOADED:
        raise ValueError(f"fsdp2:{offload}: not applicable. FSDP2 has no parameter-only offload: its "
                         f"CPUOffloadPolicy offloads parameters, gradients and the optimizer step together; "
                         f"run fsdp2:param+optimizer (or fsdp2:none) instead")


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, each an FSDP2 unit of its own (one all-gather per block, as ZeRO-3 fetches
    per module): the GPT-2 models' transformer layers (`h`). The CLIP model has none: the root alone."""
    return list(getattr(model, "h", []))


class Run:
    """One FSDP2 run: the model sharded per block and at the root, its optimizer, and `step`."""

    def __init__(self, name: str, offload: str, device: torch.device):
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        check_offload(offload)
        self.offload, self.device = offload, device
        torch.manual_seed(0)
        self.model, self.size = models.make(name, device.type)  # on the host; fully_shard moves and shards it
        offloading = offload == "param+optimizer"
        # Offloaded gradients are host DTensors and clipping all-reduces their norm: over NCCL alone that
        # fails ("No backend type associated with device type cpu"; seen with 2 ranks, torch 2.11), so the
        # run gets a group of its own with gloo for host tensors beside NCCL.
        self.group = dist.new_group(backend="cpu:gloo,cuda:nccl") if offloading and device.type == "cuda" else None
        mesh = (DeviceMesh.from_group(self.group, device.type) if self.group is not None
                else init_device_mesh(device.type, (dist.get_world_size(),)))
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offloading else OffloadPolicy()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in [*blocks(self.model), self.model]:
            fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=policy)
        self.fused = next(self.model.parameters()).device.type == "cuda"  # no fused AdamW on host tensors
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, **({"fused": True} if self.fused else {}))
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(self, args: tuple, kw: dict, target: torch.Tensor) -> tuple[float, float, float, bool]:
        """As worker.timed_step: forward with the loss, backward, then clipping, the step and the gradients
        freed (what DeepSpeed's `engine.step()` does), each timed to the device's completion. Applied: the
        gradient norm was finite (nothing skips a step here; a non-finite one would corrupt the weights)."""
        self.sync()
        t0 = time.perf_counter()
        out = self.model(*args, **kw)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
        self.sync()
        t1 = time.perf_counter()
        loss.backward()
        self.sync()
        t2 = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sync()
        t3 = time.perf_counter()
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return t1 - t0, t2 - t1, t3 - t2, bool(torch.isfinite(norm))

    def notes(self) -> dict:
        """The record's fields that say what ran, in the DeepSpeed records' terms."""
        return {"optimizer": "AdamW (fused)" if self.fused else "AdamW", "fsdp2_offload": OFFLOADED[self.offload],
                "fsdp2_units": len(blocks(self.model)) + 1, "invalidations": None, "trace_switches": None,
                "trace_recordings": None, "trace_resyncs": None, "fast_paths": []}

    def close(self) -> None:
        """Free the model and optimizer state, and the run's own process group."""
        del self.model, self.optimizer
        if self.group is not None:
            dist.destroy_process_group(self.group)
