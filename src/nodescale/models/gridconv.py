"""The smallest sensible model for gridded regression: three convolutions that keep the grid's size.

For the zarr format's samples: ``(C_in, H, W)`` windows in, ``(C_out, H, W)`` targets out, one value
per target channel and grid point (``(C, L)`` windows of one-dimensional variables use 1-D
convolutions). No pooling, so a window of any size fits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.models.section import ModelSection

WIDTH = 32


class GridConv(nn.Sequential):
    """3x3 convolution, ReLU, 3x3 convolution, ReLU, then a 1x1 convolution to the target channels."""

    block_types: tuple[type[nn.Module], ...] = ()

    def __init__(self, in_channels: int, out_channels: int, dims: int) -> None:
        conv = nn.Conv2d if dims == 2 else nn.Conv1d
        super().__init__(conv(in_channels, WIDTH, 3, padding=1), nn.ReLU(),
                         conv(WIDTH, WIDTH, 3, padding=1), nn.ReLU(),
                         conv(WIDTH, out_channels, 1))


def build_gridconv(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """GridConv from ``spec.shape[0]`` channels to ``spec.num_classes`` target channels on the same grid."""
    if spec.task != "regression" or len(spec.shape) not in (2, 3):
        raise UserError(
            f"model 'gridconv' with {spec.task} samples of shape {tuple(spec.shape)}",
            "predicts gridded targets from windows of shape (C, H, W) or (C, L)",
            "use it with --dataset zarr, or another model for this dataset",
        )
    return GridConv(spec.shape[0], spec.num_classes, len(spec.shape) - 1)
