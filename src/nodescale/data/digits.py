"""The 1,797 8x8 handwritten digits that scikit-learn ships, the default dataset.

The pixels are read straight from the CSV file inside the installed sklearn
package: ``import sklearn`` alone costs about a second of start-up in every
process, the file costs a few milliseconds. ``load_digits`` is only the
fallback for an installation laid out differently.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nodescale.data.base import DatasetSplits
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.data.section import DataSection

SCALE = 16.0  # pixels are counts 0..16 of set cells in 4x4 blocks
# Mean and std of all 1,797 x 64 pixels divided by 16, computed once from the
# shipped file (0.305260286..., 0.376049221...).
MEAN = (0.30526,)
STD = (0.37605,)
NUM_CLASSES = 10


def _csv_path() -> Path | None:
    """Where sklearn keeps digits.csv.gz, found without importing sklearn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """Pixels as uint8 ``(1797, 64)`` in 0..16 and labels as int64 ``(1797,)``."""
    path = _csv_path()
    if path is not None:
        # Each row: 64 pixel values, then the label.
        table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
        return table[:, :-1], table[:, -1].astype(np.int64)
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise UserError(
            "dataset 'digits'", "needs scikit-learn, which ships the digits", "pip install scikit-learn"
        ) from err
    bunch = load_digits()
    return bunch.data.astype(np.uint8), bunch.target.astype(np.int64)


class DigitsFormat:
    """The sklearn digits, split by ``val_fraction`` with the run's seed."""

    name = "digits"
    needs_dir = False

    def check(self, cfg: DataSection) -> None:
        """The digits need scikit-learn to be installed."""
        if importlib.util.find_spec("sklearn") is None:
            raise UserError(
                "dataset 'digits'", "needs scikit-learn, which ships the digits", "pip install scikit-learn"
            )

    def prepare(self, cfg: DataSection) -> None:
        """Nothing to prepare: the file is part of the installation."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """All digits in memory as ``(N, 1, 8, 8)`` uint8, split by ``cfg.val_fraction``."""
        import torch  # not at the top: see nodescale.data.base

        from nodescale.data.arrays import ArrayDataset
        from nodescale.data.split import seeded_split

        pixels, labels = read_digits()
        x = torch.from_numpy(np.ascontiguousarray(pixels)).view(-1, 1, 8, 8)
        y = torch.from_numpy(labels)
        train, val = seeded_split(len(x), cfg.val_fraction, seed)
        return DatasetSplits(
            train=ArrayDataset(x[train], y[train], scale=SCALE, mean=MEAN, std=STD),
            val=ArrayDataset(x[val], y[val], scale=SCALE, mean=MEAN, std=STD),
            spec=InputSpec((1, 8, 8), NUM_CLASSES),
        )


FORMAT = DigitsFormat()
