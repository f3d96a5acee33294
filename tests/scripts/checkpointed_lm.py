"""Model factories for tests/test_blockfetch.py and tests/test_world_sizes.py: the tied LM with an embedding
larger than a block (as in a language model of any size: whole blocks are fetched only then), plain or with
each block under activation checkpointing (as Hugging Face's gradient checkpointing runs a model's layers),
reentrant or not, or with parameters unused on some steps (gated)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from z3guard.scenarios.catalog import _token_batch
from z3guard.scenarios.models import TinyLM


VOCAB = 512  # embedding 32768 parameters, each block 16704


def plain() -> TinyLM:
    return TinyLM(vocab=VOCAB)


class CheckpointedLM(TinyLM):
    def __init__(self, reentrant: bool):
        super().__init__(vocab=VOCAB)
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor, step: int = 0) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.training else block(x)
        return self.head(x, self, step)


def reentrant() -> CheckpointedLM:
    return CheckpointedLM(reentrant=True)


def non_reentrant() -> CheckpointedLM:
    return CheckpointedLM(reentrant=False)


batch = _token_batch


class GatedBlock(nn.Module):
    """A block whose extra projection runs on even steps only: parameters unused, on odd steps, inside a
    block that runs."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.extra = nn.Linear(width, width)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return y + self.extra(y) if self.step % 2 == 0 else y


class GatedLM(TinyLM):
    def __init__(self, skip_odd: bool = False):
        super().__init__(vocab=VOCAB, skip_odd=skip_odd)
        self.blocks = nn.ModuleList(GatedBlock(64) for _ in range(3))

    def forward(self, tokens: torch.Tensor, step: int = 0) -> torch.Tensor:
        for block in self.blocks:
            block.step = step
        return super().forward(tokens, step)


def gated() -> GatedLM:
    return GatedLM()


def gated_skip() -> GatedLM:
    """Gated blocks, and the middle one left out on odd steps: a whole block unused, and parameters unused
    inside blocks that run."""
    return GatedLM(skip_odd=True)


def gated_skip_leaf() -> GatedLM:
    """The same, each block made a ZeRO-3 leaf module by hand: DeepSpeed's own leaf gradient path."""
    from deepspeed.utils import set_z3_leaf_module

    model = gated_skip()
    for block in model.blocks:
        set_z3_leaf_module(block, True)
    return model
