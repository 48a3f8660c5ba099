"""STAND-IN, replaced by the tokens format at merge (``nodescale.data.tokens.load_token_splits``).

Only so the text formats can be loaded end to end on this branch: windows of
seq_len + 1 tokens at stride seq_len over ``train.bin`` and ``val.bin``, with
the dtype and vocabulary size of ``meta.json``. Delete this file at merge.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from nodescale.data.base import DatasetSplits
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.data.section import DataSection

SEQ_LEN = 64  # data.seq_len comes with the tokens format


class _Windows(Dataset):
    def __init__(self, path: Path, dtype: str, seq_len: int) -> None:
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


def load_token_splits(directory: Path, cfg: DataSection, seed: int) -> DatasetSplits:
    meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    train, val = (_Windows(directory / f"{split}.bin", meta["dtype"], SEQ_LEN) for split in ("train", "val"))
    return DatasetSplits(train, val, InputSpec((SEQ_LEN,), meta["vocab_size"], "language_modeling"))
