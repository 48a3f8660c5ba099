"""Random images and labels, for benchmarks that must not wait on storage.

Nothing is learnable here: the point is throughput. Images are drawn already
normalised (standard normal), so they are float32 with no scaling; small
in-memory sets are moved to the device once and batches are cut there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nodescale.data.base import DatasetSplits
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.data.section import DataSection

DEFAULT_SIZE = 32


class SyntheticFormat:
    """``cfg.samples`` random images of ``cfg.channels`` x S x S, S = ``cfg.image_size`` or 32."""

    name = "synthetic"
    needs_dir = False

    def check(self, cfg: DataSection) -> None:
        """Nothing to check: the schema bounds every field used."""

    def prepare(self, cfg: DataSection) -> None:
        """Nothing to prepare."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """``cfg.samples`` training and ``max(1, samples // 8)`` validation samples drawn from ``seed``."""
        import torch  # not at the top: see nodescale.data.base

        from nodescale.data.arrays import ArrayDataset

        side = cfg.image_size or DEFAULT_SIZE
        shape = (cfg.channels, side, side)
        generator = torch.Generator(device="cpu").manual_seed(seed)

        def draw(n: int) -> ArrayDataset:
            x = torch.randn((n, *shape), generator=generator, dtype=torch.float32)
            y = torch.randint(0, cfg.num_classes, (n,), generator=generator, dtype=torch.int64)
            return ArrayDataset(x, y)

        train = draw(cfg.samples)
        val = draw(max(1, cfg.samples // 8))
        return DatasetSplits(train, val, InputSpec(shape, cfg.num_classes))


FORMAT = SyntheticFormat()
