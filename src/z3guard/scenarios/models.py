"""Small models that reproduce ZeRO-3 trace hazards; shared by `repro`, tests and bench."""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

EMBED = 512  # the report's width: biases (512) are persistent, weights (512*512) are not
IMAGE = 16
PATCH = 4
CLASSES = 10


class AttentionPool2d(nn.Module):
    """CLIP's attention pooling: hands its projections' tensors to F.multi_head_attention_forward.

    The four nn.Linear children never run, so ZeRO-3 only learns of their parameters when this
    module's forward reads them: the pattern behind the report.
    """

    def __init__(self, spacial_dim: int, embed_dim: int, num_heads: int, output_dim: int | None = None):
        super().__init__()
        self.positional_embedding = nn.Parameter(torch.randn(spacial_dim**2 + 1, embed_dim) / embed_dim**0.5)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.c_proj = nn.Linear(embed_dim, output_dim or embed_dim)
        self.num_heads = num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(start_dim=2).permute(2, 0, 1)  # NCHW -> (HW)NC
        x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0)
        x = x + self.positional_embedding[:, None, :].to(x.dtype)
        x, _ = F.multi_head_attention_forward(
            query=x[:1], key=x, value=x, embed_dim_to_check=x.shape[-1], num_heads=self.num_heads,
            q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight, in_proj_weight=None,
            in_proj_bias=torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]),
            bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
            out_proj_weight=self.c_proj.weight, out_proj_bias=self.c_proj.bias,
            use_separate_proj_weight=True, training=self.training, need_weights=False)
        return x.squeeze(0)


class VisualEncoder(nn.Module):
    def __init__(self, width: int = EMBED, checkpointing: str | None = None):
        super().__init__()
        self.stem = nn.Conv2d(3, width, kernel_size=PATCH, stride=PATCH)
        self.attnpool = AttentionPool2d(IMAGE // PATCH, width, num_heads=8)
        self.checkpointing = checkpointing  # None | "reentrant" | "non-reentrant"

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.stem(images))
        if self.checkpointing and self.training:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.attnpool, x, use_reentrant=self.checkpointing == "reentrant")
        return self.attnpool(x)


class ClipLike(nn.Module):
    """Stem -> attention pooling -> head, as in the report's custom CLIP-style model."""

    def __init__(self, width: int = EMBED, classes: int = CLASSES, checkpointing: str | None = None):
        super().__init__()
        self.visual = VisualEncoder(width, checkpointing)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.visual(images))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.act = nn.GELU()  # a module without parameters, as transformers' blocks have

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class LMHead(nn.Module):
    """Final norm and an output projection tied to the embedding, read directly from another module.

    On steps where `side_read_every` divides the step it also reads the first block's fc1.weight:
    a cross-module read that happens only on some batches.
    """

    def __init__(self, width: int, side_read_every: int = 0, side_read_via: str = "attribute"):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.side_read_every = side_read_every
        # how the side read reaches the weight: "attribute" (`.weight`), "gathered" (inside
        # deepspeed.zero.GatheredParameters, through named_parameters()) or "parameters" (`parameters()`)
        self.side_read_via = side_read_via
        self.inflight_reads = 0  # side reads handed a parameter whose all-gather was still in flight
        self.read_states: list[str] = []  # the read weight's ZeRO status at each side read
        self.data_read_steps: list[int] = []  # steps whose batch made this rank read blocks[0].norm.bias

    def forward(self, x: torch.Tensor, lm: "TinyLM", step: int, data_read: bool = False) -> torch.Tensor:
        if data_read:  # a small persistent parameter of another module, read when the batch says so
            self.data_read_steps.append(step)
            x = x + lm.blocks[0].norm.bias
        if self.side_read_every and step % self.side_read_every == 0:
            weight = next(lm.blocks[0].fc1.parameters()) if self.side_read_via == "parameters" else \
                lm.blocks[0].fc1.weight
            state = getattr(getattr(weight, "ds_status", None), "name", "")
            self.inflight_reads += state == "INFLIGHT"
            self.read_states.append(state)
            if self.side_read_via == "gathered":  # the whole block gathered, its weight read through named_parameters()
                import deepspeed

                with deepspeed.zero.GatheredParameters(list(lm.blocks[0].parameters())):
                    x = x + dict(lm.blocks[0].named_parameters())["fc1.weight"].mean(0)
            else:
                x = x + weight.mean(0)
        return F.linear(self.norm(x), lm.embed.weight)


class Routed(nn.Module):
    """A block made of `n` expert blocks of which one runs per step, as top-1 routing of a whole
    micro-batch picks it. The pick is a function of the step and the layer, so that it is the same on
    every rank (ZeRO-3 needs every rank to gather the same parameters) and the module order changes
    on every step, in a combination no earlier step ran."""

    def __init__(self, width: int, n: int, layer: int):
        super().__init__()
        self.experts = nn.ModuleList(Block(width) for _ in range(n))
        self.layer = layer

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        pick = random.Random(7919 * step + self.layer).randrange(len(self.experts))
        return self.experts[pick](x)


class TinyLM(nn.Module):
    """Embedding -> blocks -> head whose projection is the embedding's weight (tied, read directly).

    `skip_odd` drops the middle block on odd steps (a module order that changes between steps);
    `experts` > 0 makes every block a routed choice among that many (an order that changes every step).
    The step comes in as an argument so that the pattern survives a resume and is the same on
    every rank.
    """

    def __init__(self, vocab: int = 64, width: int = 64, depth: int = 3, skip_odd: bool = False,
                 side_read_every: int = 0, repeat_first: bool = False, experts: int = 0, data_read: bool = False,
                 branch: bool = False, skip_every: int = 0, side_read_via: str = "attribute"):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Routed(width, experts, i) if experts else Block(width) for i in range(depth))
        self.head = LMHead(width, side_read_every, side_read_via)
        self.skip_odd = skip_odd
        self.skip_every = skip_every  # the middle block is left out on steps that this divides
        self.repeat_first = repeat_first  # the first block runs twice per step (weight sharing)
        self.data_read = data_read  # the head reads blocks[0].norm.bias when the batch's first token is even
        self.extra = Block(width) if branch else None  # run only for batches that bring an `image`

    def forward(self, tokens: torch.Tensor, step: int = 0, image: bool = False) -> torch.Tensor:
        x = self.embed(tokens)
        if image and self.extra is not None:  # a branch for some batches: LLaVA's image tower, say
            x = self.extra(x)
        if self.repeat_first:
            x = self.blocks[0](x)
        for i, block in enumerate(self.blocks):
            middle = i == len(self.blocks) // 2
            if middle and (self.skip_odd and step % 2 == 1 or self.skip_every and step % self.skip_every == 0):
                continue
            x = block(x, step) if isinstance(block, Routed) else block(x)
        return self.head(x, self, step, self.data_read and int(tokens[0, 0]) % 2 == 0)


class PlainMLP(nn.Module):
    """Nothing unusual: every module uses only its own parameters."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(3 * IMAGE * IMAGE, width)
        self.fc2 = nn.Linear(width, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(images.flatten(1))))
