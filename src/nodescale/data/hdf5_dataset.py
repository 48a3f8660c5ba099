"""Samples of the hdf5 format, read from the file one item at a time.

Apart from ``nodescale.data.hdf5`` because it needs torch, which the launcher's
``check`` must not import; ``HDF5Format.load`` imports it.

h5py handles must not cross a fork, so each process (and DataLoader worker)
opens the file itself on its first read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from nodescale.data.hdf5 import IMAGENET_MEAN, IMAGENET_STD, open_file

if TYPE_CHECKING:
    from nodescale.data.hdf5 import Part


class HDF5Dataset(Dataset):
    """Samples of one images dataset (optionally a subset of its rows), read per item."""

    def __init__(self, path: Path, part: Part, rows: torch.Tensor | None = None) -> None:
        self.path = str(path)
        self.images_key = part.images_key
        self.layout = part.layout
        self.rows = None if rows is None else rows.numpy()
        self.labels = part.labels if rows is None else part.labels[rows]
        channels = self.layout.shape[0]
        mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,) * channels, (0.5,) * channels)
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)
        self._file: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = index if self.rows is None else int(self.rows[index])
        x = torch.from_numpy(np.asarray(self._images()[row]))
        if self.layout.hwc:
            x = x.permute(2, 0, 1)
        x = x.reshape(self.layout.shape).float()
        if self.layout.scale != 1.0:
            x = x / self.layout.scale
        return (x - self.mean) / self.std, self.labels[index]

    def _images(self) -> Any:
        # A handle inherited through fork is unusable: open one per process.
        if self._file is None or self._pid != os.getpid():
            self._file = open_file(self.path)
            self._pid = os.getpid()
        return self._file[self.images_key]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"], state["_pid"] = None, -1  # handles do not pickle (spawned workers)
        return state
