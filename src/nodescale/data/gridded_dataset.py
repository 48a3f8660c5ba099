"""Samples of the zarr format: windows cut from a block of the store read whole and kept until the next.

Apart from ``nodescale.data.gridded`` because it needs torch, which the launcher's ``check`` must
not import; ``GriddedFormat.load`` imports it. Store handles are opened per process (and per
DataLoader worker) on the first read: a handle inherited through fork may not work.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from nodescale.data.gridded import handle, open_store, read

if TYPE_CHECKING:
    from nodescale.data.grid import Grid
    from nodescale.data.gridded import Layout


class WindowDataset(Dataset):
    """The windows of ``grid`` over the layout's variables; ``sample_groups`` tells the plan its blocks."""

    def __init__(self, layout: Layout, grid: Grid, scale: list[tuple[float, float]] | None = None) -> None:
        self.layout = layout
        self.grid = grid
        self.scale = scale  # each variable's (mean, std), inputs then targets: standardised as read
        self._variables: list[Any] = []  # the store's handles, opened in this process
        self._pid = -1
        self._block = -1  # the block whose arrays are held, with the element where each starts
        self._arrays: list[np.ndarray] = []
        self._origin: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.grid)

    @property
    def sample_groups(self) -> tuple[int, ...]:
        """Sizes of the consecutive index runs (blocks) read together: ``ShardPlan`` deals them whole."""
        return tuple(int(size) for size in self.grid.block_sizes)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        block, positions = self.grid.locate(index)
        window = self.grid.window_region(positions)
        if not self.layout.whole_blocks:  # too big to hold: read this window alone
            arrays = self._read(window)
        else:
            if block != self._block:
                region = self.grid.block_region(block)
                self._arrays, self._origin, self._block = self._read(region), tuple(s.start for s in region), block
            inside = tuple(slice(s.start - o, s.stop - o) for s, o in zip(window, self._origin, strict=True))
            arrays = [array[inside] for array in self._arrays]
        if self.scale is not None:
            arrays = [(a - mean) / std for a, (mean, std) in zip(arrays, self.scale, strict=True)]
        split = len(self.layout.inputs)
        return _stacked(arrays[:split]), _stacked(arrays[split:])

    def _read(self, region: tuple[slice, ...]) -> list[np.ndarray]:
        kind = self.layout.kind
        if self._pid != os.getpid():
            store = open_store(self.layout.path, kind)
            self._variables = [handle(store, kind, var.name) for var in (*self.layout.inputs, *self.layout.targets)]
            self._pid = os.getpid()
        return [read(variable, kind, region) for variable in self._variables]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_variables=[], _pid=-1, _block=-1, _arrays=[], _origin=())  # handles do not pickle
        return state


def _stacked(arrays: list[np.ndarray]) -> torch.Tensor:
    """The variables' windows as channels: dimensions before the last two folded into them."""
    keep = 2 if arrays[0].ndim > 1 else 1
    return torch.from_numpy(np.concatenate([a.reshape(-1, *a.shape[-keep:]) for a in arrays]))
