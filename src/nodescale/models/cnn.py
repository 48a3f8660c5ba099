"""The small ConvNet of CSC's MNIST examples: two conv blocks and a linear layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.models.section import ModelSection


class ConvBlock(nn.Module):
    """5x5 convolution (size-preserving), BatchNorm, ReLU, then 2x2 max-pooling."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=5, padding=2)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.relu(self.bn(self.conv(x))))


class ConvNet(nn.Module):
    """``layer1`` (16 channels) and ``layer2`` (32 channels), then ``fc`` to the classes."""

    block_types: tuple[type[nn.Module], ...] = (ConvBlock,)

    def __init__(self, channels: int, height: int, width: int, num_classes: int) -> None:
        super().__init__()
        self.layer1 = ConvBlock(channels, 16)
        self.layer2 = ConvBlock(16, 32)
        # Each block halves the sides (rounding down), hence the // 4.
        self.fc = nn.Linear(32 * (height // 4) * (width // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer2(self.layer1(x))
        return self.fc(out.flatten(1))


def build_cnn(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """The ConvNet for ``(C, H, W)`` images of at least 4x4 pixels."""
    if not spec.is_image:
        raise UserError(
            f"model 'cnn' with samples of shape {tuple(spec.shape)}",
            "needs images of shape (C, H, W)",
            "use model toy for feature vectors",
        )
    channels, height, width = spec.shape
    if height < 4 or width < 4:
        raise UserError(
            f"model 'cnn' with {height}x{width} images",
            "its two 2x2 max-pools need images of at least 4x4 pixels",
            "use larger images (data.image_size for synthetic or imagefolder data)",
        )
    return ConvNet(channels, height, width, spec.num_classes)
