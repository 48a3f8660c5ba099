"""The standard image augmentation, seeded per sample: a random resized crop, then a horizontal flip.

A sample's crop and flip are a function of (seed, epoch, sample index) alone, drawn from a
counter-based hash rather than a stateful generator: the same on any rank, in any worker, in
any batch, so a run resumed mid-epoch draws the crops it would have drawn. The crop box is
torchvision's ``RandomResizedCrop`` (area 8-100 %, aspect ratio 3/4-4/3, ten tries, then the
centre) and is resized back to the image's own size; both are one ``affine_grid`` +
``grid_sample`` over the whole batch, so the same code runs on the device (in-memory and
GPU-decoded batches) and, a decoded batch at a time, in DataLoader workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

from nodescale.data.decoded_batches import reads_batches

TRIES = 10
DRAWS = 4 * TRIES + 1  # area, ratio, top, left per try; then the flip
_MASK = np.uint64(2**64 - 1)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose outputs look independent."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seed: int, epoch: int, indices: np.ndarray, draws: int) -> np.ndarray:
    """``(len(indices), draws)`` numbers in [0, 1), a pure function of (seed, epoch, index, draw)."""
    key = _mix(np.array([(seed * 1_000_003 + epoch) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    counters = (np.asarray(indices, dtype=np.uint64)[:, None] * np.uint64(draws)
                + np.arange(draws, dtype=np.uint64)[None, :])
    with np.errstate(over="ignore"):
        bits = _mix(_mix(counters ^ key) + key)
    return (bits >> np.uint64(11)).astype(np.float64) / float(2**53)


@dataclass(frozen=True)
class Augment:
    """Random resized crop + horizontal flip, seeded by the run's seed."""

    seed: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5

    def boxes(self, epoch: int, indices: np.ndarray, height: int, width: int) -> np.ndarray:
        """Each sample's crop as ``(top, left, h, w, flipped)`` rows of float64."""
        u = uniforms(self.seed, epoch, indices, DRAWS)
        area = height * width * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, 0:4 * TRIES:4])
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, 1:4 * TRIES:4])
        w = np.round(np.sqrt(area * aspect))
        h = np.round(np.sqrt(area / aspect))
        fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        first = np.argmax(fits, axis=1)  # the first try that fits, as torchvision takes it
        rows = np.arange(len(first))
        h, w = h[rows, first], w[rows, first]
        top = np.floor(u[rows, 4 * first + 2] * (height - h + 1))
        left = np.floor(u[rows, 4 * first + 3] * (width - w + 1))
        # No try fitted: torchvision's fallback, the largest centre crop within the ratio range.
        fallback = ~fits.any(axis=1)
        if fallback.any():
            in_ratio = width / height
            if in_ratio < self.ratio[0]:
                cw, ch = width, round(width / self.ratio[0])
            elif in_ratio > self.ratio[1]:
                cw, ch = round(height * self.ratio[1]), height
            else:
                cw, ch = width, height
            h[fallback], w[fallback] = ch, cw
            top[fallback], left[fallback] = (height - ch) // 2, (width - cw) // 2
        flipped = (u[:, -1] < self.flip).astype(np.float64)
        return np.stack([top, left, h, w, flipped], axis=1)

    def __call__(self, images: torch.Tensor, epoch: int, indices: Any) -> torch.Tensor:
        """``images`` ``(N, C, H, W)`` (float, any device) cropped, resized back to ``H x W`` and flipped."""
        indices = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices)
        _, _, height, width = images.shape
        box = self.boxes(epoch, indices, height, width)
        top, left, h, w, flipped = (box[:, k] for k in range(5))
        # Output coordinates in [-1, 1] (pixel edges, align_corners=False) map onto the crop box.
        theta = np.zeros((len(indices), 2, 3))
        theta[:, 0, 0] = (w / width) * (1.0 - 2.0 * flipped)
        theta[:, 0, 2] = (2.0 * left + w) / width - 1.0
        theta[:, 1, 1] = h / height
        theta[:, 1, 2] = (2.0 * top + h) / height - 1.0
        theta_t = torch.from_numpy(theta).to(device=images.device, dtype=images.dtype)
        grid = F.affine_grid(theta_t, list(images.shape), align_corners=False)
        return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


class AugmentedDataset(Dataset):
    """``dataset``'s samples augmented in the worker that decodes them; keyed by ``(epoch, index)``.

    ``EpochLoader`` hands such a dataset its epoch with each index (``keyed_by_epoch``): persistent
    workers never see an attribute set in the main process after they started.
    """

    keyed_by_epoch = True

    def __init__(self, dataset: Dataset, augment: Augment) -> None:
        self.dataset = dataset
        self.augment = augment

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # sample_groups, unreadable, stage_shards, ...: the plan and ctx.loader ask the dataset underneath.
        if name in ("dataset", "augment"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, Any]:
        epoch, index = key
        x, y = self.dataset[index]
        return self.augment(x[None], epoch, [index])[0], y

    def read_batch(self, keys: list[tuple[int, int]]) -> list[Any]:
        """A batch augmented in one call, decoded whole where the dataset underneath can (``read_batch``)."""
        epoch, indices = keys[0][0], [index for _, index in keys]
        if reads_batches(self.dataset):
            x, y = self.dataset.read_batch(indices)  # type: ignore[attr-defined]
        else:
            x, y = default_collate([self.dataset[index] for index in indices])
        return [self.augment(x, epoch, indices), y]
