"""Token windows: the samples of language modelling, cut from one long 1-D array of token ids.

Sample ``i`` is the window ``tokens[i*T : i*T + T + 1]`` (``T``: ``data.seq_len``): its first
``T`` tokens are the input, its last ``T`` the targets, each the token after its input. Windows
start every ``T`` tokens, so every token after the first is a target exactly once per pass.
The engine's ``ShardPlan`` deals windows like any samples, each exactly once per epoch across
ranks, and a checkpoint's position (epoch, batch) is a position in the token stream.

The array is a tensor in memory (moved to the accelerator when small, the engine's resident
path) or a numpy memory map, where a batch reads only its own windows: a 100 GB file costs no
memory. Imports torch: format modules import this inside ``load`` only (see ``data.base``).
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from nodescale.data.arrays import WholeBatchDataset, copy_to_device
from nodescale.data.base import DatasetSplits
from nodescale.models.spec import InputSpec

# A memory map moved to an accelerator is held as int32 (torch has few uint16/uint32 kernels).
RESIDENT_DTYPE = np.int32


class TokenWindows(WholeBatchDataset):
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` over ``tokens``: ``(x, y)``, int64 ``(seq_len,)``."""

    def __init__(self, tokens: torch.Tensor | np.ndarray, seq_len: int) -> None:
        count = (len(tokens) - 1) // seq_len
        if seq_len < 1 or count < 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of {seq_len} + 1")
        self.tokens, self.seq_len = tokens, seq_len
        used = tokens[:count * seq_len + 1]  # views either way: nothing is read or copied here
        self._windows = (used.unfold(0, seq_len + 1, seq_len) if isinstance(used, torch.Tensor)
                         else sliding_window_view(used, seq_len + 1)[::seq_len])

    def __len__(self) -> int:
        return len(self._windows)

    def get_batch(self, indices: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self._windows, torch.Tensor):
            windows = self._windows[indices.to(self._windows.device)]
        else:  # a memory map: only these windows are read
            windows = torch.from_numpy(self._windows[indices.numpy()].astype(np.int64))
        windows = copy_to_device(windows, device).long()
        return windows[:, :-1], windows[:, 1:]

    @property
    def storage_device(self) -> torch.device:
        return self.tokens.device if isinstance(self.tokens, torch.Tensor) else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        if isinstance(self.tokens, torch.Tensor):
            return self.tokens.numel() * self.tokens.element_size()
        return len(self.tokens) * np.dtype(RESIDENT_DTYPE).itemsize

    def to(self, device: torch.device, channels_last: bool = False) -> TokenWindows:
        tokens = self.tokens
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.from_numpy(np.asarray(tokens).astype(RESIDENT_DTYPE))
        return TokenWindows(tokens.to(device), self.seq_len)


def token_splits(train: torch.Tensor | np.ndarray, val: torch.Tensor | np.ndarray, seq_len: int,
                 vocab_size: int) -> DatasetSplits:
    """Training and validation windows over two token arrays, for a model of ``vocab_size`` outputs."""
    return DatasetSplits(TokenWindows(train, seq_len), TokenWindows(val, seq_len),
                         InputSpec((seq_len,), vocab_size, "language_modeling"))

