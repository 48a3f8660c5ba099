"""The PyTorch DDP tutorial's model: linear regression on feature vectors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.models.section import ModelSection


class LinearRegression(nn.Linear):
    """One ``nn.Linear`` from ``F`` features to the regression targets.

    A subclass rather than a bare ``nn.Linear`` only to declare, like every
    model here, that it has no repeated blocks.
    """

    block_types: tuple[type[nn.Module], ...] = ()


def build_toy(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """Linear regression from ``spec.shape[0]`` features to ``spec.num_classes`` targets."""
    if len(spec.shape) != 1:
        raise UserError(
            f"model 'toy' with samples of shape {tuple(spec.shape)}",
            "the toy model is a linear regression over feature vectors of shape (F,)",
            "use an image model (cnn, resnet18, vit_tiny) for images, or a regression dataset with toy",
        )
    return LinearRegression(spec.shape[0], spec.num_classes)
