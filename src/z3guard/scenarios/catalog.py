"""Named scenarios: a model, its batches and its loss, everything a rank needs to train it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .models import CLASSES, EMBED, IMAGE, AttentionPool2d, ClipLike, PlainMLP, TinyLM

Batch = tuple[tuple, dict, torch.Tensor]  # forward args, forward kwargs, target


@dataclass(frozen=True)
class Scenario:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int, int, int, torch.dtype], Batch]  # (step, micro, rank, dtype)
    hidden: int
    micro_batch: int = 4
    config: dict[str, Any] = field(default_factory=dict)  # overrides of the resolved HF config
    # (reading module, parameter) pairs read across modules: what a stock user would have to
    # pass to deepspeed.zero.register_external_parameter, the documented workaround.
    reads: tuple[tuple[str, str], ...] = ()
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None  # the user's (output, target) -> loss

    def loss(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        """The user's loss function if given; else the model's own loss (a scalar output, or an output's
        `.loss` as Hugging Face models return with labels); else cross-entropy of the logits."""
        if self.loss_fn is not None:
            return self.loss_fn(out, target)
        if getattr(out, "loss", None) is not None:
            return out.loss
        if torch.is_tensor(out) and out.dim() == 0:
            return out
        out = getattr(out, "logits", out)  # Hugging Face models return an output object
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def _clip_with_leaf_pooling() -> nn.Module:
    """The documented workaround: ZeRO-3 fetches a leaf module's whole subtree at once."""
    from deepspeed.utils import set_z3_leaf_modules

    model = ClipLike()
    set_z3_leaf_modules(model, [AttentionPool2d])
    return model


def _gen(step: int, micro: int, rank: int) -> torch.Generator:
    # A pure function of the position in training: resuming needs no data-loader state.
    return torch.Generator().manual_seed(1_000_003 * step + 1_009 * micro + rank)


def _image_batch(step: int, micro: int, rank: int, dtype: torch.dtype, n: int = 4) -> Batch:
    g = _gen(step, micro, rank)
    images = torch.randn(n, 3, IMAGE, IMAGE, generator=g).to(dtype)
    return (images,), {}, torch.randint(0, CLASSES, (n,), generator=g)


def _token_batch(step: int, micro: int, rank: int, dtype: torch.dtype, n: int = 4) -> Batch:
    g = _gen(step, micro, rank)
    tokens = torch.randint(0, 64, (n, 9), generator=g)
    return (tokens[:, :-1],), {"step": step}, tokens[:, 1:]


def _image_on_rank0_batch(step: int, micro: int, rank: int, dtype: torch.dtype) -> Batch:
    """Token batches of which rank 0's bring an image on every fourth step and rank 1's never."""
    args, kwargs, target = _token_batch(step, micro, rank, dtype)
    return args, {**kwargs, "image": rank == 0 and step % 4 == 0}, target


CLIP_READS = tuple(("visual.attnpool", f"visual.attnpool.{proj}.{kind}")
                   for proj in ("q_proj", "k_proj", "v_proj", "c_proj") for kind in ("weight", "bias"))

LM_SCALE = {"fp16": {"initial_scale_power": 8}}

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("clip", ClipLike, _image_batch, hidden=EMBED, reads=CLIP_READS),
        Scenario("clip-leaf", _clip_with_leaf_pooling, _image_batch, hidden=EMBED),
        Scenario("clip-ckpt-reentrant", lambda: ClipLike(checkpointing="reentrant"), _image_batch,
                 hidden=EMBED, reads=CLIP_READS),
        Scenario("clip-ckpt-non-reentrant", lambda: ClipLike(checkpointing="non-reentrant"), _image_batch,
                 hidden=EMBED, reads=CLIP_READS),
        # LM width 64: HF "auto" persistence threshold 640 keeps biases/norms persistent, weights not.
        # A lower initial loss scale than the report's 2^16, so that no step overflows on its own.
        Scenario("tied", lambda: TinyLM(), _token_batch, hidden=64, config=LM_SCALE,
                 reads=(("head", "embed.weight"),)),
        Scenario("skip-block", lambda: TinyLM(skip_odd=True), _token_batch, hidden=64, config=LM_SCALE,
                 reads=(("head", "embed.weight"),)),
        # The middle block is left out on every fourth step only: the trace is complete by then and has
        # prefetched the block's weights, which that step never uses.
        Scenario("skip-sometimes", lambda: TinyLM(skip_every=4), _token_batch, hidden=64,
                 config={**LM_SCALE, "zero_optimization": {"stage3_prefetch_bucket_size": 10**6}},
                 reads=(("head", "embed.weight"),)),
        Scenario("moe", lambda: TinyLM(experts=4, depth=4), _token_batch, hidden=64, config=LM_SCALE,
                 reads=(("head", "embed.weight"),)),
        # Reuse distance 0: a weight is released after each use, so the late read finds it partitioned.
        Scenario("mlp", lambda: PlainMLP(), _image_batch, hidden=64),
        Scenario("twice", lambda: TinyLM(repeat_first=True), _token_batch, hidden=64, config=LM_SCALE,
                 reads=(("head", "embed.weight"),)),
        # The head reads a persistent bias of another module when the batch says so: on one rank only on
        # some steps, since each rank has its own batches.
        Scenario("rank-read", lambda: TinyLM(data_read=True), _token_batch, hidden=64, config=LM_SCALE,
                 reads=(("head", "embed.weight"), ("head", "blocks.0.norm.bias"))),
        # A branch that rank 0's batches take on some steps and rank 1's never: ZeRO-3 cannot go on.
        Scenario("rank-branch", lambda: TinyLM(branch=True), _image_on_rank0_batch, hidden=64, config=LM_SCALE,
                 reads=(("head", "embed.weight"),)),
        Scenario("side-read", lambda: TinyLM(side_read_every=3), _token_batch, hidden=64,
                 config={**LM_SCALE, "zero_optimization": {"stage3_max_reuse_distance": 0}},
                 reads=(("head", "embed.weight"), ("head", "blocks.0.fc1.weight"))),
        # The same read, inside `deepspeed.zero.GatheredParameters` over the block in the head's forward and
        # through the block's named_parameters().
        Scenario("gathered-read", lambda: TinyLM(side_read_every=3, side_read_via="gathered"), _token_batch,
                 hidden=64, config={**LM_SCALE, "zero_optimization": {"stage3_max_reuse_distance": 0}},
                 reads=(("head", "embed.weight"), ("head", "blocks.0.fc1.weight"))),
        # The same read through the block's parameters(), which no getter sees.
        Scenario("parameters-read", lambda: TinyLM(side_read_every=3, side_read_via="parameters"), _token_batch,
                 hidden=64, config={**LM_SCALE, "zero_optimization": {"stage3_max_reuse_distance": 0}},
                 reads=(("head", "embed.weight"), ("head", "blocks.0.fc1.weight"))),
    ]
}


def _import(spec: str, flag: str) -> Callable:
    import importlib

    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{flag} {spec!r}: expected 'package.module:function'")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{flag} {spec!r}: cannot import it ({exc}); the ranks import from the current "
                         "directory and PYTHONPATH") from exc
    if not callable(factory):
        raise ValueError(f"{flag} {spec!r}: {type(factory).__name__} is not callable")
    return factory


def hf_causal_lm(path: str, layers: int | None = None) -> Scenario:
    """A local Hugging Face config (or model) folder, built from its config (no weights, no downloads),
    with random token batches. `layers`: that many of its decoder layers, which repeat the same hazards,
    so that a 70B config can be examined on CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not Path(path).is_dir():
        raise ValueError(f"--hf {path}: not a folder; expected a local Hugging Face config or model folder")
    config = AutoConfig.from_pretrained(path)
    if layers is not None:
        total = getattr(config, "num_hidden_layers", None)
        if not isinstance(total, int):
            raise ValueError(f"--layers {layers}: {path}/config.json has no num_hidden_layers to cut")
        if not 0 < layers <= total:
            raise ValueError(f"--layers {layers}: expected 1 to {total}, the layers {path}/config.json has")
        config.num_hidden_layers = layers
        for name in ("layer_types", "mlp_only_layers"):  # per-layer lists some configs keep in step
            if isinstance(getattr(config, name, None), list) and len(getattr(config, name)) == total:
                setattr(config, name, getattr(config, name)[:layers])
    vocab = config.vocab_size

    def make_batch(step: int, micro: int, rank: int, dtype: torch.dtype) -> Batch:
        tokens = torch.randint(0, vocab, (2, 17), generator=_gen(step, micro, rank))
        return (), {"input_ids": tokens[:, :-1]}, tokens[:, 1:]

    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 512)
    return Scenario(f"hf:{path}", lambda: AutoModelForCausalLM.from_config(config), make_batch, hidden=hidden)


def resolve(name: str, model: str | None = None, batch: str | None = None, hidden: int = 512,
            hf_path: str | None = None, loss: str | None = None, layers: int | None = None) -> Scenario:
    """A built-in scenario by name, a local Hugging Face folder, or one made of a user's own factories:
    `model` returns an nn.Module; `batch(step, micro, rank, dtype)` returns (args, kwargs, target);
    `loss(output, target)` returns the loss (default: see `Scenario.loss`)."""
    if layers is not None and not hf_path:
        raise ValueError("--layers applies to --hf (a Hugging Face config) only")
    if hf_path:
        scenario = hf_causal_lm(hf_path, layers)
    elif model is None and batch is None:
        scenario = get(name)
    elif model is None or batch is None:
        raise ValueError("a custom scenario needs both --model (the model factory) and --batch (the batch factory)")
    else:
        scenario = Scenario(f"{model}+{batch}", _import(model, "--model"), _import(batch, "--batch"), hidden=hidden)
    if loss is not None:
        scenario = dataclasses.replace(scenario, loss_fn=_import(loss, "--loss"))
    return scenario


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
