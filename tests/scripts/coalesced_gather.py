"""Gather many ZeRO-3 parameters at once, again and again, and count the gathers that handed back a
tensor other than the parameter's: through DeepSpeed's coalesced gather (stock) and z3guard's adapter.
Writes <out>/gather.rank<r>.json. Run on every rank of a gloo group."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from z3guard import adapter


def wrong_gathers(params: list[nn.Parameter], want: list[torch.Tensor], gather, repeats: int) -> int:
    wrong = 0
    for _ in range(repeats):
        gather(params)
        wrong += any(not torch.equal(p.data.view(w.shape), w) for p, w in zip(params, want))
        time.sleep(0.05)  # all-gathers 0.14 did not wait for write into these buffers: let them finish first
        params[0].partition(param_list=params, has_been_updated=False)
    return wrong


def main(out: Path, repeats: int) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=cfg, dtype=torch.float16):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])
    params = list(model.parameters())
    want = []
    for p in params:  # one at a time: a single parameter's gather blocks
        with deepspeed.zero.GatheredParameters([p]):
            want.append(p.detach().clone())
    result = {"stock": wrong_gathers(params, want, lambda ps: ps[0].all_gather(param_list=ps), repeats),
              "z3guard": wrong_gathers(params, want, adapter.load().gather, repeats),
              "repeats": repeats, "deepspeed": deepspeed.__version__}
    (out / f"gather.rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
