"""ResNet-18/34/50/101/152, layer for layer torchvision's, with a choice of stem.

The blocks, widths, initialisation and parameter names match
``torchvision.models.resnet`` (v1.5: a Bottleneck strides in its 3x3
convolution), so parameter counts are equal; the state-dict keys follow
torchvision's too (untested here, torchvision is not installed). The CIFAR stem (3x3 stride-1 convolution, no
max-pool) keeps small images from shrinking to 1x1 before the last stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.models.section import ModelSection

Stem = Literal["imagenet", "cifar"]

# "auto" picks the CIFAR stem up to this image side (CIFAR 32, Tiny-ImageNet 64).
CIFAR_STEM_MAX_SIDE = 64


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding, no bias (a BatchNorm follows)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution, no bias (a BatchNorm follows)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, and a shortcut (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem, four stages of residual blocks, global average pool, linear classifier."""

    block_types: tuple[type[nn.Module], ...] = (BasicBlock, Bottleneck)

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        layers: tuple[int, int, int, int],
        in_channels: int,
        num_classes: int,
        stem: Stem,
    ) -> None:
        super().__init__()
        self.stem_kind = stem  # which stem was built, for logs and tests
        self.inplanes = 64
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:
            self.conv1 = conv3x3(in_channels, 64)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

        # torchvision's initialisation; the Linear keeps PyTorch's default.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.constant_(module.weight, 1)
                nn.init.constant_(module.bias, 0)

    def _make_layer(
        self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            # A projection shortcut where the shape changes.
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def choose_stem(cfg: ModelSection, spec: InputSpec) -> Stem:
    """``cfg.stem``, with "auto" resolved by image size: CIFAR stem up to 64 pixels."""
    if cfg.stem != "auto":
        return cfg.stem
    return "cifar" if spec.image_size <= CIFAR_STEM_MAX_SIDE else "imagenet"


def _build(
    name: str,
    block: type[BasicBlock | Bottleneck],
    layers: tuple[int, int, int, int],
    cfg: ModelSection,
    spec: InputSpec,
) -> ResNet:
    if not spec.is_image:
        raise UserError(
            f"model {name!r} with samples of shape {tuple(spec.shape)}",
            "needs images of shape (C, H, W)",
            "use model toy for feature vectors",
        )
    return ResNet(block, layers, spec.channels, spec.num_classes, choose_stem(cfg, spec))


def build_resnet18(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """ResNet-18: basic blocks, 2-2-2-2."""
    return _build("resnet18", BasicBlock, (2, 2, 2, 2), cfg, spec)


def build_resnet34(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """ResNet-34: basic blocks, 3-4-6-3."""
    return _build("resnet34", BasicBlock, (3, 4, 6, 3), cfg, spec)


def build_resnet50(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """ResNet-50: bottleneck blocks, 3-4-6-3."""
    return _build("resnet50", Bottleneck, (3, 4, 6, 3), cfg, spec)


def build_resnet101(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """ResNet-101: bottleneck blocks, 3-4-23-3."""
    return _build("resnet101", Bottleneck, (3, 4, 23, 3), cfg, spec)


def build_resnet152(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """ResNet-152: bottleneck blocks, 3-8-36-3."""
    return _build("resnet152", Bottleneck, (3, 8, 36, 3), cfg, spec)
