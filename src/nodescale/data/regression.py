"""The PyTorch DDP tutorial's random regression data, made learnable.

The tutorial trains on pure noise; here the target is a noisy linear function
of the inputs, ``y = x @ w_true + b + 0.1 * noise``, so the loss falls towards
the noise floor (0.01 mean squared error) and a broken training loop shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nodescale.data.base import DatasetSplits
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.data.section import DataSection

FEATURES = 20
NOISE = 0.1


class RegressionFormat:
    """``cfg.samples`` feature vectors of 20 standard-normal values with one float target each."""

    name = "regression"
    needs_dir = False

    def check(self, cfg: DataSection) -> None:
        """Nothing to check: the schema bounds ``samples``."""

    def prepare(self, cfg: DataSection) -> None:
        """Nothing to prepare."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """``cfg.samples`` training and ``max(1, samples // 5)`` validation pairs, all from ``seed``."""
        import torch  # not at the top: see nodescale.data.base

        from nodescale.data.arrays import ArrayDataset

        generator = torch.Generator(device="cpu").manual_seed(seed)
        w_true = torch.randn(FEATURES, 1, generator=generator)
        b_true = torch.randn(1, generator=generator)

        def draw(n: int) -> ArrayDataset:
            x = torch.randn(n, FEATURES, generator=generator)
            y = x @ w_true + b_true + NOISE * torch.randn(n, 1, generator=generator)
            return ArrayDataset(x, y)

        train = draw(cfg.samples)
        val = draw(max(1, cfg.samples // 5))
        return DatasetSplits(train, val, InputSpec((FEATURES,), 1, "regression"))


FORMAT = RegressionFormat()
