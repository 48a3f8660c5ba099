"""Turn a rank's ``ShardPlan`` into device batches.

In-memory ``ArrayDataset``s are cut one whole batch at a time (on the device,
when they fit there); other datasets go through a ``DataLoader`` with worker
processes, pinned memory and non-blocking copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from nodescale.data.arrays import ArrayDataset, copy_to_device
from nodescale.data.sharding import Batch, ShardPlan

# Datasets up to this size are moved to the accelerator once, so batches are
# cut on the device with no host work per step (digits, MNIST, CIFAR-10 all fit).
RESIDENT_BYTES = 2 * 1024**3


@dataclass
class DeviceBatch:
    """A batch on the device with its padding weights and the step's global sample count."""

    x: torch.Tensor
    y: torch.Tensor
    weights: torch.Tensor
    global_count: int
    real_count: int  # real samples of this rank, known on the host without a device sync


class StepLoader:
    """Yields one rank's batches for an epoch, from a given step on."""

    def __init__(
        self,
        dataset: Dataset,
        plan: ShardPlan,
        device: torch.device,
        num_workers: int = 0,
        channels_last: bool = False,
        persistent_workers: bool = True,
    ) -> None:
        self.plan = plan
        self.device = device
        self.channels_last = channels_last
        if isinstance(dataset, ArrayDataset) and device.type != "cpu" and dataset.nbytes <= RESIDENT_BYTES:
            # Stored channels_last once: the per-batch conversion below is then a no-op.
            dataset = dataset.to(device, channels_last=channels_last)
        self.dataset = dataset
        self._ones: dict[int, torch.Tensor] = {}  # full batches' weights, made on the device once
        self._sampler = PlannedBatches()
        self._loader: DataLoader | None = None
        if not isinstance(dataset, ArrayDataset):
            self._loader = DataLoader(
                dataset,
                batch_sampler=self._sampler,
                num_workers=num_workers,
                pin_memory=device.type == "cuda",
                persistent_workers=persistent_workers and num_workers > 0,
                prefetch_factor=4 if num_workers > 0 else None,
            )

    def __len__(self) -> int:
        return self.plan.steps_per_epoch

    def epoch(self, epoch: int, start_step: int = 0, batches: list[Batch] | None = None) -> Iterator[DeviceBatch]:
        """The epoch's batches from ``start_step`` on; pass ``batches`` if the caller planned them already."""
        if batches is None:
            batches = self.plan.batches(epoch, start_step)
        if isinstance(self.dataset, ArrayDataset):
            for batch, indices in zip(batches, _indices_on(self.dataset.x.device, batches), strict=True):
                x, y = self.dataset.get_batch(indices, self.device)
                yield self._with_weights(x, y, batch)
            return
        assert self._loader is not None
        self._sampler.batches = [batch.indices.tolist() for batch in batches]
        for batch, (x, y) in zip(batches, self._loader, strict=True):
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            yield self._with_weights(x, y, batch)

    def _with_weights(self, x: torch.Tensor, y: torch.Tensor, batch: Batch) -> DeviceBatch:
        real = batch.real_count
        size = len(batch.weights)
        if real == size:  # almost every batch: no per-step host-to-device copy
            if size not in self._ones:
                self._ones[size] = torch.ones(size, device=self.device)
            weights = self._ones[size]
        else:
            weights = copy_to_device(batch.weights, self.device)
        if self.channels_last and x.dim() == 4:  # a copy only for batches not cut from a channels_last store
            x = x.contiguous(memory_format=torch.channels_last)
        return DeviceBatch(x, y, weights, batch.global_count, real)


def _indices_on(device: torch.device, batches: list[Batch]) -> list[torch.Tensor]:
    """Each batch's sample indices on ``device``, moved there in one copy for the whole epoch.

    Indexing a CUDA tensor with CPU indices copies them with a blocking copy, which waits for
    every queued kernel: one host synchronisation per step, and the GPU idles while Python
    queues the next step. One pinned, non-blocking copy per epoch keeps the steps free of it.
    """
    if device.type == "cpu" or not batches:
        return [batch.indices for batch in batches]
    on_device = copy_to_device(torch.cat([batch.indices for batch in batches]), device)
    return list(on_device.split([len(batch.indices) for batch in batches]))


class PlannedBatches:
    """A batch sampler whose batches are set per epoch (works with persistent workers)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
