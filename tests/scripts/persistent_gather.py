"""Persistent parameters gathered by z3guard's one collective (`persistent.coalesced_gather_`), from their
partitions and again in place: their values against DeepSpeed's own gather, and whether each owns its
storage (a view into the shared gathered buffer would be released and gathered again at every step).
Writes <out>/persistent.rank<r>.json. Run on every rank of a gloo group."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from z3guard.adapter import persistent


def main(out: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.float16):
        model = nn.Sequential(*[nn.Linear(33, 33) for _ in range(4)], nn.LayerNorm(33))  # odd sizes: padded at 2 ranks
    params = list(model.parameters())
    want = []
    for p in params:  # DeepSpeed's own gather, one parameter at a time
        with deepspeed.zero.GatheredParameters([p]):
            want.append(p.detach().clone())
    device = torch.device("cpu")
    persistent.coalesced_gather_(params, device)  # from the partitions
    fresh = {"equal": all(torch.equal(p.data, w) for p, w in zip(params, want)),
             "own_storage": sum(persistent._owns_storage(p.data) for p in params)}
    where = [p.data.data_ptr() for p in params]
    persistent.coalesced_gather_(params, device)  # gathered already: refreshed in place
    again = {"equal": all(torch.equal(p.data, w) for p, w in zip(params, want)),
             "in_place": sum(p.data.data_ptr() == d for p, d in zip(params, where))}
    result = {"params": len(params), "fresh": fresh, "refreshed": again}
    (out / f"persistent.rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears the group down while another still gathers
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: gloo/shm threads can abort there after a clean run


if __name__ == "__main__":
    main(Path(sys.argv[1]))
