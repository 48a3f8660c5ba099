"""Windows over an N-dimensional array, numbered block by block so that a block's samples read the same chunks.

Pure arithmetic over shapes (numpy, no torch, no files): ``nodescale.data.gridded`` describes the
rule; this module computes where sample ``i`` lies and which elements its block covers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from nodescale.errors import UserError


@dataclass(frozen=True)
class Grid:
    """``count[d]`` windows of ``window[d]`` elements every ``stride[d]`` along each dimension ``d``, the
    first at window position ``first[d]``; samples numbered block by block, ``per_block[d]`` positions
    a block along each dimension, blocks and the samples inside each in row-major order."""

    window: tuple[int, ...]
    stride: tuple[int, ...]
    first: tuple[int, ...]
    count: tuple[int, ...]
    per_block: tuple[int, ...]

    @functools.cached_property
    def _along(self) -> list[np.ndarray]:
        """Along each dimension, the positions in each block (the last block may hold fewer)."""
        return [np.minimum(per, n - np.arange(0, n, per)) for n, per in zip(self.count, self.per_block, strict=True)]

    @functools.cached_property
    def block_sizes(self) -> np.ndarray:
        """Samples in each block, blocks in row-major order."""
        return functools.reduce(np.multiply.outer, self._along).reshape(-1)

    @functools.cached_property
    def _block_starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.block_sizes)])

    def __len__(self) -> int:
        return int(self._block_starts[-1])

    def locate(self, index: int) -> tuple[int, tuple[int, ...]]:
        """Sample ``index``'s block number and its window positions along each dimension."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        block = int(np.searchsorted(self._block_starts, index, side="right")) - 1
        corner = np.unravel_index(block, [len(a) for a in self._along])
        inside = np.unravel_index(index - int(self._block_starts[block]),
                                  [int(a[c]) for a, c in zip(self._along, corner, strict=True)])
        return block, tuple(f + int(c) * p + int(i) for f, c, p, i in
                            zip(self.first, corner, self.per_block, inside, strict=True))

    def window_region(self, positions: tuple[int, ...]) -> tuple[slice, ...]:
        """The elements of the window at ``positions``."""
        return tuple(slice(p * s, p * s + w) for p, s, w in zip(positions, self.stride, self.window, strict=True))

    def block_region(self, block: int) -> tuple[slice, ...]:
        """The elements every window of ``block`` covers (whole chunks where windows align to them)."""
        corner = np.unravel_index(block, [len(a) for a in self._along])
        region = []
        for d, c in enumerate(corner):
            start = self.first[d] + int(c) * self.per_block[d]
            last = start + int(self._along[d][c]) - 1
            region.append(slice(start * self.stride[d], last * self.stride[d] + self.window[d]))
        return tuple(region)


def block_bytes(grid: Grid, variables: int) -> int:
    """Bytes of the largest block of ``variables`` variables, as float32."""
    extent = [(min(p, n) - 1) * s + w for p, n, s, w in zip(grid.per_block, grid.count, grid.stride, grid.window,
                                                              strict=True)]
    return 4 * variables * math.prod(extent)


def split_grids(dims: tuple[str, ...], shape: tuple[int, ...], window: tuple[int, ...], stride: tuple[int, ...],
                chunks: list[tuple[int, ...]], val_fraction: float, where: str) -> tuple[Grid, Grid]:
    """The training and validation grids: the last ``val_fraction`` of the windows along the first dimension
    with two windows or more, in whole blocks where there are two blocks or more along it.

    ``chunks[d]`` holds each variable's chunk length along dimension ``d``; a block spans their least
    common multiple with the stride, so it starts on a chunk boundary of every variable.
    """
    count = tuple((size - w) // s + 1 for size, w, s in zip(shape, window, stride, strict=True))
    per_block = tuple(math.lcm(s, *lengths) // s for s, lengths in zip(stride, chunks, strict=True))
    split = next((d for d, n in enumerate(count) if n >= 2), None)
    if split is None:
        raise UserError(f"windows of {dict(zip(dims, window, strict=True))} in {where}",
                        f"fit only once in the arrays of {dict(zip(dims, shape, strict=True))}, leaving none to "
                        "validate on", "make data.window smaller along one dimension at least")
    n, per = count[split], per_block[split]
    blocks = -(-n // per)
    if blocks >= 2:
        train_count = (blocks - min(max(round(blocks * val_fraction), 1), blocks - 1)) * per
    else:
        train_count = n - min(max(round(n * val_fraction), 1), n - 1)
    zero = (0,) * len(dims)
    train = Grid(window, stride, zero, count[:split] + (train_count,) + count[split + 1:], per_block)
    first = zero[:split] + (train_count,) + zero[split + 1:]
    val = Grid(window, stride, first, count[:split] + (n - train_count,) + count[split + 1:], per_block)
    return train, val
