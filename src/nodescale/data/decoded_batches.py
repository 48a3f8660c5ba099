"""Decoded samples written straight into one batch tensor, in the DataLoader worker that decodes them.

The usual ``Dataset`` returns one tensor per sample and the DataLoader's collation copies them
into a batch (``torch.stack``): for 224 px float images that copy, into freshly faulted memory,
took longer than the JPEG decode (``benchmarks/input_pipeline.py``). A dataset with
``read_batch(indices)`` decodes each sample into its slot of a batch allocated once, in shared
memory when in a worker (as the DataLoader's own collation does), so the batch crosses to the
training process without another copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info


def batch_tensor(count: int, shape: Sequence[int], shared: bool | None = None) -> torch.Tensor:
    """An uninitialised float32 ``(count, *shape)``; in shared memory inside a DataLoader worker."""
    if shared is None:
        shared = get_worker_info() is not None
    if not shared:
        return torch.empty((count, *shape))
    # The DataLoader's default_collate allocates its batches the same way (a private call, there since torch 1.x).
    storage = torch.empty(0)._typed_storage()._new_shared(count * math.prod(shape), device="cpu")
    return torch.empty(0).new(storage).view(count, *shape)


def reads_batches(dataset: Dataset) -> bool:
    """Whether ``dataset`` decodes whole batches (asked of its class: wrappers forward attributes)."""
    return callable(getattr(type(dataset), "read_batch", None))


class BatchesRead(Dataset):
    """``dataset`` as the DataLoader sees it: a batch sampler's indices fetched in one ``read_batch``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        return [self.dataset.read_batch(indices)]  # type: ignore[attr-defined]


def whole_batch(samples: list[Any]) -> Any:
    """The collation of :class:`BatchesRead`: its one item is the batch."""
    return samples[0]
