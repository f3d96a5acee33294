"""Hugging Face Trainer + DeepSpeed ZeRO-3 (CPU offload) on the CLIP-style model; run with torchrun.

    hf_trainer_resume.py OUT --phase straight|first|resume [--guard] [--skip-at 6]

`first` stops after saving at step 4 (as an interrupted job would); `resume` continues with
`trainer.train(resume_from_checkpoint=True)`. Losses go to OUT/<phase>-losses.json.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from resume_args import parse_args  # tests/scripts/, beside this file

args = parse_args()

if args.guard:
    import z3guard

    z3guard.install()  # the one line a Trainer user adds

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from z3guard.scenarios.config import resolve_auto  # noqa: E402
from z3guard.scenarios.models import CLASSES, IMAGE, ClipLike  # noqa: E402


class ClipForTrainer(nn.Module):
    def __init__(self):
        super().__init__()
        self.clip = ClipLike()

    def forward(self, pixel_values, labels):
        logits = self.clip(pixel_values.to(next(self.parameters()).dtype))
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"pixel_values": torch.randn(3, IMAGE, IMAGE, generator=g),
                "labels": torch.randint(0, CLASSES, (), generator=g)}


class SkipOneStep(Trainer):
    """Makes one step's loss non-finite, so DeepSpeed skips that step (as an fp16 overflow would)."""

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if self.state.global_step + 1 == args.skip_at:
            loss = loss * math.inf
        return loss


class StopAfterSave(TrainerCallback):
    def on_step_end(self, targs, state, control, **kwargs):
        if args.phase == "first" and state.global_step == 4:
            control.should_save = True
            control.should_training_stop = True


ds = resolve_auto(hidden_size=512, dtype="bf16", micro_batch=4, world_size=2)
for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "gradient_clipping"):
    ds[key] = "auto"  # Trainer fills these from its own arguments
ds["fp16"]["enabled"] = "auto"
ds["bf16"]["enabled"] = "auto"
run_dir = args.out / ("straight" if args.phase == "straight" else f"resumed{'-guarded' if args.guard else ''}")
targs = TrainingArguments(output_dir=str(run_dir), max_steps=args.steps, per_device_train_batch_size=4,
                          gradient_accumulation_steps=args.grad_accum,
                          learning_rate=1e-3, logging_steps=1, save_steps=4, save_strategy="steps", bf16=True,
                          deepspeed=None if args.config_from_launcher else ds, report_to=[], seed=1234, data_seed=1234, dataloader_num_workers=0,
                          disable_tqdm=True, save_only_model=False, use_cpu=True)
torch.manual_seed(1234)
trainer = SkipOneStep(model=ClipForTrainer(), args=targs, train_dataset=Images(), callbacks=[StopAfterSave()])
try:
    trainer.train(resume_from_checkpoint=True if args.phase == "resume" else None)
    crash = None
except RuntimeError as exc:
    crash = str(exc)
losses = {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}
if trainer.args.process_index == 0:
    (args.out / f"{args.phase}{'-guarded' if args.guard else ''}.json").write_text(
        json.dumps({"losses": losses, "crash": crash}))
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # skip interpreter teardown: gloo/shm threads can abort there after a clean run
