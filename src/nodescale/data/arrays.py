"""In-memory datasets whose batches are cut from tensors in one indexing call.

Small and medium datasets (digits, MNIST, CIFAR-10, synthetic) live in memory
as uint8 (or float) tensors. A batch is one fancy-index plus one normalisation
on the target device, so no per-sample Python or collate work sits in the
training loop, and uint8 pixels cross the host-device link at a quarter of the
float32 cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset


class WholeBatchDataset(Dataset):
    """A dataset that cuts a whole batch in one call: the loader's fast path (no per-sample Python).

    Where ``nbytes`` is small enough the loader moves it to the accelerator once (``to``),
    so batches are cut there with no host work per step.
    """

    def get_batch(self, indices: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``indices`` (int64, on ``storage_device``) as one batch on ``device``."""
        raise NotImplementedError

    @property
    def storage_device(self) -> torch.device:
        """Where the samples are (the indices of a batch are moved there)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes the samples take on an accelerator once moved there."""
        raise NotImplementedError

    def to(self, device: torch.device, channels_last: bool = False) -> WholeBatchDataset:
        """The same samples on ``device``."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([index]), torch.device("cpu"))
        return x[0], y[0]


class ArrayDataset(WholeBatchDataset):
    """Samples ``x[i]`` with labels ``y[i]``, normalised as ``(x / scale - mean) / std``.

    ``mean`` and ``std`` hold one value per channel (dimension 1 of ``x``) or a
    single value; they are applied after dividing by ``scale`` (255 for 8-bit
    pixels, 16 for the 4-bit digits, 1 for data that is already float).
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        scale: float = 1.0,
        mean: Sequence[float] = (0.0,),
        std: Sequence[float] = (1.0,),
    ) -> None:
        if len(x) != len(y):
            raise ValueError(f"{len(x)} inputs but {len(y)} labels")
        self.x = x
        self.y = y
        self.scale = float(scale)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        # Mean 0 and std 1 (synthetic data, float already): nothing to subtract or divide per batch.
        self._standardise = any(m != 0.0 for m in self.mean) or any(s != 1.0 for s in self.std)
        self._stats: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.x)

    def get_batch(
        self, indices: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``indices``, normalised, as float32 on ``device``."""
        indices = indices.to(self.x.device)
        x = copy_to_device(self.x[indices], device)
        y = copy_to_device(self.y[indices], device)
        return self._normalise(x), y

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.scale != 1.0:
            x = x / self.scale
        if not self._standardise:
            return x
        mean, std = self._stats_for(x)
        return (x - mean) / std

    def _stats_for(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Made once per device and rank of input, not once per batch: the step stays free
        # of host-to-device copies.
        key = (x.device, x.dim())
        if key not in self._stats:
            shape = (1, -1) + (1,) * (x.dim() - 2) if x.dim() > 1 else (-1,)
            self._stats[key] = (torch.tensor(self.mean, device=x.device).view(shape),
                                torch.tensor(self.std, device=x.device).view(shape))
        return self._stats[key]

    @property
    def storage_device(self) -> torch.device:
        return self.x.device

    @property
    def nbytes(self) -> int:
        return self.x.numel() * self.x.element_size() + self.y.numel() * self.y.element_size()

    def to(self, device: torch.device, channels_last: bool = False) -> ArrayDataset:
        """The same samples with their tensors on ``device`` (batches are then cut there).

        With ``channels_last``, 4-D inputs are stored channels_last once: a batch indexed from
        them and normalised keeps that layout, so no batch needs a conversion copy.
        """
        x = self.x
        if channels_last and x.dim() == 4:  # converted before the copy, which keeps the layout
            x = x.contiguous(memory_format=torch.channels_last)
        return ArrayDataset(x.to(device), self.y.to(device), scale=self.scale, mean=self.mean, std=self.std)


def copy_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host batch bound for CUDA is pinned first, so the copy does not block the host.

    A non-blocking copy from pageable memory is staged by the driver and waits for it; from
    pinned memory it is queued and returns at once (torch keeps the pinned block until it is done).
    """
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
