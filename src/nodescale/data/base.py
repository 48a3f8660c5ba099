"""The contract between a dataset format and the rest of nodescale.

A dataset format is one module in ``nodescale.data`` holding a
:class:`DatasetFormat`. The registry (``nodescale.data.registry``) lists formats
by name without importing them, so validating a configuration stays cheap.

The launcher calls ``check`` before it starts the workers and never imports
torch (1.5 s), so a format module imports torch only inside ``load`` (directly,
or through a sibling module such as ``hdf5_dataset`` that ``load`` imports):
its top level, ``check`` and ``prepare`` stay torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from nodescale.data.section import DataSection


@dataclass
class DatasetSplits:
    """Training and validation sets and the shape of their samples.

    Both sets return ``(x, y)`` per index, ``x`` a float32 tensor of
    ``spec.shape`` and ``y`` an int64 class (classification) or a float32
    vector of ``spec.num_classes`` targets (regression); for language
    modelling both are int64 token ids of shape ``(seq_len,)``, ``y`` the
    tokens that follow ``x``'s. Sets that can cut a whole batch at once
    (a ``WholeBatchDataset``: ``ArrayDataset``, ``TokenWindows``) also have
    ``get_batch``.
    """

    train: Dataset
    val: Dataset
    spec: InputSpec


class DatasetFormat(Protocol):
    """One data format: cheap checks, one-per-node preparation, loading."""

    name: str
    needs_dir: bool

    def check(self, cfg: DataSection) -> None:
        """Cheap checks before any process starts (files exist); raise ``UserError``."""

    def prepare(self, cfg: DataSection) -> None:
        """One process per node: idempotent work such as building a file index."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        """Both splits; any split of one set must depend on ``seed`` only."""
