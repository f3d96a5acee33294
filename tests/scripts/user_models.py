"""Models and batches as a user hands them to `z3guard doctor` / `verify-resume` (`--model`, `--batch`).

`ResNetPool` is CLIP's ResNet visual tower in small (open_clip's ModifiedResNet): convolutions with
BatchNorm, whose running statistics are fp32 buffers unless the model is built under `zero.Init`, and
attention pooling that hands its projections' weights to `F.multi_head_attention_forward`, reading
parameters of four modules that never run themselves."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from z3guard.scenarios.models import AttentionPool2d

WIDTH = 64  # with --hidden 64, Trainer's "auto" threshold (640) keeps biases persistent and weights not
IMAGE = 16
CLASSES = 10


class ResNetPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, WIDTH // 2, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(WIDTH // 2)
        self.conv2 = nn.Conv2d(WIDTH // 2, WIDTH, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(WIDTH)
        self.attnpool = AttentionPool2d(IMAGE // 4, WIDTH, num_heads=4)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(images)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(self.attnpool(x))


class OwnLoss(nn.Module):
    """Returns its loss, as a Hugging Face model does when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * IMAGE * IMAGE, CLASSES)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(images.flatten(1)).float(), labels)


class Broken(nn.Module):
    """Fails in its first forward for a reason that has nothing to do with ZeRO-3."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * IMAGE * IMAGE, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten_wrongly(images))

    def flatten_wrongly(self, images: torch.Tensor) -> torch.Tensor:
        raise ValueError("the user's model fails here on purpose")


def resnet_pool() -> nn.Module:
    return ResNetPool()


def own_loss() -> nn.Module:
    return OwnLoss()


def broken() -> nn.Module:
    return Broken()


def unbuildable() -> nn.Module:
    return nn.Linear(IMAGE, -1)


def images(step: int, micro: int, rank: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1_000_003 * step + 1_009 * micro + rank)
    batch = torch.randn(4, 3, IMAGE, IMAGE, generator=g).to(dtype)
    return (batch,), {}, torch.randint(0, CLASSES, (4,), generator=g)


def images_and_labels(step: int, micro: int, rank: int, dtype: torch.dtype):
    (batch,), _, labels = images(step, micro, rank, dtype)
    return (batch, labels), {}, labels


def images_without_micro(step: int, rank: int):  # the signature an earlier release documented
    return images(step, 0, rank, torch.float16)


def not_a_batch(step: int, micro: int, rank: int, dtype: torch.dtype):
    return images(step, micro, rank, dtype)[0]


def narrow_lm() -> nn.Module:
    """The `tied` scenario's model at half its width: the same parameter names, other shapes."""
    from z3guard.scenarios.models import TinyLM

    return TinyLM(width=32)
