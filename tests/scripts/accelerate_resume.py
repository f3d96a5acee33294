"""accelerate (DeepSpeed plugin, ZeRO-3 with CPU offload) on the CLIP-style model; run with torchrun.

    accelerate_resume.py OUT --phase straight|first|resume [--guard] [--skip-at 6]

`first` trains 4 steps and `save_state`s; `resume` `load_state`s in a fresh process group and
continues to step 8 with step `--skip-at` made non-finite. Losses go to OUT/<phase>[-guarded].json.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from resume_args import parse_args  # tests/scripts/, beside this file

args = parse_args()

if args.guard:
    import z3guard

    z3guard.install()  # the one line an accelerate user adds

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402

from z3guard.scenarios.config import resolve_auto  # noqa: E402
from z3guard.scenarios.models import CLASSES, IMAGE, ClipLike  # noqa: E402

ds = resolve_auto(hidden_size=512, dtype="bf16", micro_batch=4, world_size=int(os.environ.get("WORLD_SIZE", 2)))
accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
torch.manual_seed(1234)
model = ClipLike()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
state_dir = args.out / f"state{'-guarded' if args.guard else ''}"

start = 0
if args.phase == "resume":
    accelerator.load_state(str(state_dir))
    start = 4
stop = 4 if args.phase == "first" else args.steps
losses, crash = {}, None
try:
    for step in range(start + 1, stop + 1):
        g = torch.Generator().manual_seed(1000 * step + accelerator.process_index)
        images = torch.randn(4, 3, IMAGE, IMAGE, generator=g).to(torch.bfloat16)
        labels = torch.randint(0, CLASSES, (4,), generator=g)
        loss = F.cross_entropy(model(images).float(), labels)
        losses[str(step)] = loss.item()
        accelerator.backward(loss * math.inf if step == args.skip_at else loss)
        optimizer.step()
        optimizer.zero_grad()
except RuntimeError as exc:
    crash = str(exc)
if args.phase == "first":
    accelerator.save_state(str(state_dir))
if accelerator.is_main_process:
    (args.out / f"{args.phase}{'-guarded' if args.guard else ''}.json").write_text(
        json.dumps({"losses": losses, "crash": crash}))
accelerator.wait_for_everyone()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # skip interpreter teardown: gloo/shm threads can abort there after a clean run
