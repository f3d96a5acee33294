"""Benchmark models built from a transformers GPT-2 config (no downloads), plus the report's CLIP model."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Size:
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int  # sequences per rank

    @classmethod
    def of(cls, device: str, model: str = "gpt2") -> "Size":
        if device != "cuda":
            return cls(layers=4, width=64, heads=4, vocab=256, seq=32, batch=2)
        if model == "big":  # blocks of 0.8B parameters (a 70B model's layer holds 0.86B), 1 x 1024 tokens
            return cls(layers=4, width=8192, heads=64, vocab=32000, seq=1024, batch=1)
        if model == "llama":  # Llama-shaped, 1.34B parameters, 4 x 1024 tokens
            return cls(layers=24, width=2048, heads=16, vocab=32000, seq=1024, batch=4)
        return cls(layers=24, width=1024, heads=16, vocab=50257, seq=1024, batch=4)  # GPT-2 medium, 4 x 1024


def _config(size: Size):
    from transformers import GPT2Config

    return GPT2Config(n_layer=size.layers, n_embd=size.width, n_head=size.heads, n_positions=size.seq,
                      vocab_size=size.vocab, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


class GPT2Like(nn.Module):
    """GPT-2 blocks from transformers; `skip_odd` drops block layers//2 on odd steps, `experts` > 0
    replaces each block's MLP by a top-1 routed mixture (the module order then follows the data)."""

    def __init__(self, size: Size, skip_odd: bool = False, experts: int = 0):
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config = _config(size)
        self.wte = nn.Embedding(size.vocab, size.width)
        self.wpe = nn.Embedding(size.seq, size.width)
        self.h = nn.ModuleList(GPT2Block(config, layer_idx=i) for i in range(size.layers))
        if experts:
            for block in self.h:
                block.mlp = RoutedMLP(config, experts)
        self.ln_f = nn.LayerNorm(size.width)
        self.skip_odd = skip_odd

    def forward(self, tokens: torch.Tensor, step: int = 0) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for i, block in enumerate(self.h):
            if self.skip_odd and i == len(self.h) // 2 and step % 2 == 1:
                continue
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied output projection, read directly


class LlamaLike(nn.Module):
    """Llama decoder layers from transformers (multi-head attention as Llama 2 7B's, SwiGLU MLP of 2.6875x
    the width, RMSNorm, rotary positions), an untied output projection. The layers are `h`, as GPT2Like's."""

    def __init__(self, size: Size):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        config = LlamaConfig(hidden_size=size.width, intermediate_size=size.width * 43 // 16,
                             num_hidden_layers=size.layers, num_attention_heads=size.heads,
                             num_key_value_heads=size.heads, vocab_size=size.vocab,
                             max_position_embeddings=size.seq, attn_implementation="sdpa")
        self.embed = nn.Embedding(size.vocab, size.width)
        self.rotary = LlamaRotaryEmbedding(config)
        self.h = nn.ModuleList(LlamaDecoderLayer(config, layer_idx=i) for i in range(size.layers))
        self.norm = LlamaRMSNorm(size.width, eps=config.rms_norm_eps)
        self.head = nn.Linear(size.width, size.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, step: int = 0) -> torch.Tensor:
        x = self.embed(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        rotary = self.rotary(x, positions)
        for block in self.h:
            x = block(x, position_ids=positions, position_embeddings=rotary)
            x = x[0] if isinstance(x, tuple) else x  # transformers 4 returns (hidden_states, ...)
        return self.head(self.norm(x))


class RoutedMLP(nn.Module):
    """Top-1 routing of the whole micro-batch to one of `n` expert MLPs. The router's choice is
    agreed across ranks (ZeRO-3 needs every rank to gather the same parameters), so which expert
    runs, and hence the module order, changes with the data from step to step."""

    def __init__(self, config, n: int):
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

        self.router = nn.Linear(config.n_embd, n)
        self.experts = nn.ModuleList(GPT2MLP(4 * config.n_embd, config) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        logits = self.router(x.detach()).float().mean(dim=(0, 1))
        if dist.is_initialized():
            dist.all_reduce(logits)
        return self.experts[int(logits.argmax())](x)


def make(model: str, device: str) -> tuple[nn.Module, Size]:
    size = Size.of(device, model)
    if model in ("gpt2", "big"):
        return GPT2Like(size), size
    if model == "llama":
        return LlamaLike(size), size
    if model == "gpt2-leaf":  # each block fetched whole: DeepSpeed's leaf-module setting, as a user sets it
        from deepspeed.utils import set_z3_leaf_modules
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        model_ = GPT2Like(size)
        set_z3_leaf_modules(model_, [GPT2Block])
        return model_, size
    if model == "gpt2-skip":
        return GPT2Like(size, skip_odd=True), size
    if model == "gpt2-moe":
        return GPT2Like(size, experts=4), size
    if model == "clip":
        from z3guard.scenarios.models import ClipLike

        return ClipLike(), size
    raise ValueError(f"unknown model {model!r}")


def batch(model: str, size: Size, step: int, rank: int, device: torch.device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(7919 * step + rank)
    if model == "clip":
        from z3guard.scenarios.models import CLASSES, IMAGE

        images = torch.randn(4 * size.batch, 3, IMAGE, IMAGE, generator=g).to(device, dtype)
        return (images,), {}, torch.randint(0, CLASSES, (4 * size.batch,), generator=g).to(device), images.shape[0]
    tokens = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=g).to(device)
    return (tokens[:, :-1],), {"step": step}, tokens[:, 1:], size.batch * size.seq


# Dense fp16/bf16 tensor-core peaks (no sparsity) of the GPUs the records were made on, by a piece of the
# name torch reports; elsewhere no MFU is given rather than a guessed one.
PEAK_FLOPS = {"H200": 989.4e12, "H100 80GB HBM3": 989.4e12, "H100 SXM": 989.4e12, "H100 PCIe": 756.5e12,
              "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for piece, peak in PEAK_FLOPS.items() if piece in name), None)


@lru_cache
def flops_per_token(model: str, device: str) -> float | None:
    """A training step's model FLOPs per token: 6 per parameter (forward and backward) plus attention's
    12 x layers x width x sequence (PaLM's appendix B), counted on a copy built on the meta device. None
    for the image model."""
    if model == "clip":
        return None
    with torch.device("meta"):
        built, size = make(model, device)
    return 6.0 * sum(p.numel() for p in built.parameters()) + 12.0 * size.layers * size.width * size.seq
