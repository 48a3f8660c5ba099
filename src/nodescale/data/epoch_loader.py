"""The library's loader: a ``ShardPlan`` dealt through a ``DataLoader``, every sample exactly once.

``ShardPlan`` pads each rank's shard to equal step counts with weight-0 samples. A
user's loop cannot see weights, so this loader drops the padding: each rank gets
only its real samples, and the last batches of an epoch may differ in size between
ranks. The loss stays the global mean because ``ctx.backward`` scales a batch's mean
loss by ``real_count * W / window_total`` (the counts come from the plan, without
communication). Only where a rank would be a whole step short (its last batch holds
no real sample) does it get one padding sample, so that every rank runs the same
number of steps; ``ctx.backward`` weighs that batch 0, and ``loader.real_count`` says
0 for it. The position (epoch, batch) is saved in checkpoints and resumed on any
world size with the same global batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from nodescale.data.arrays import ArrayDataset
from nodescale.data.loader import PlannedBatches
from nodescale.data.sharding import ShardPlan, window_totals


@dataclass(frozen=True)
class DrawnBatch:
    """What ``ctx.backward`` and ``ctx.step`` need to know of the micro-batch just drawn."""

    real_count: int  # this rank's real samples (0 for a padding batch)
    window_total: int  # real samples of its accumulation window, across all ranks
    closes_window: bool  # the last micro-batch of its window: gradients are synchronised


class EpochLoader:
    """Iterating gives one epoch of this rank's batches; the next iteration gives the next epoch."""

    def __init__(self, dataset: Dataset, plan: ShardPlan, *, pad: bool, drop_last: bool, grad_accum: int,
                 device: torch.device, on_batch: Callable[[DrawnBatch], None] | None = None,
                 **loader_options: Any) -> None:
        self.plan = plan
        self.pad = pad  # keep every rank at the same step count (training); False: evaluation shards
        self.drop_last = drop_last
        self.grad_accum = grad_accum
        self.device = device
        self.on_batch = on_batch
        self.epoch = 0
        self.batch_in_epoch = 0  # batches of this epoch already drawn: the resume point
        # Where the next iteration starts: an epoch's end, a loaded position or set_epoch. An iteration
        # left unfinished (a peek with next(iter(loader)), a break) is begun again from there.
        self._next_start = (0, 0)
        self.real_count = 0  # real samples in the batch drawn last
        self._batches = PlannedBatches()
        loader_options.setdefault("pin_memory", device.type == "cuda")
        self.loader = DataLoader(dataset, batch_sampler=self._batches, **loader_options)
        # Tensors in memory are cut a whole batch at a time: the same values as the DataLoader's
        # per-sample collation, without a Python call per sample (a plain TensorDataset's options
        # beyond pin_memory would change what it yields, so they keep the DataLoader).
        plain = set(loader_options) <= {"pin_memory"}
        self._cut = (_array_cutter(dataset) if isinstance(dataset, ArrayDataset) and plain
                     else _tensor_cutter(dataset) if isinstance(dataset, TensorDataset) and plain else None)

    @property
    def sampler(self) -> PlannedBatches:  # the old EpochLoader's attribute
        return self._batches

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank (the last batches of an epoch may hold fewer)."""
        return self.plan.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of ``epoch``."""
        self.epoch, self.batch_in_epoch = epoch, 0
        self._next_start = (epoch, 0)

    def __len__(self) -> int:
        return self._steps()

    def _steps(self) -> int:
        steps = self.plan.steps_per_epoch
        if self.drop_last and self.plan.num_samples % (self.plan.batch_size * self.plan.world_size):
            steps = self.plan.num_samples // (self.plan.batch_size * self.plan.world_size)
        return steps

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._next_start
        steps = self._steps()
        self.epoch, self.batch_in_epoch = epoch, start
        planned = self.plan.batches(epoch, start)[:steps - start]
        totals = window_totals([b.global_count for b in planned], start, self.grad_accum)
        kept = []
        for batch in planned:
            real = batch.indices[batch.weights > 0]
            if len(real) == 0 and self.pad:
                real = batch.indices[:1]  # one padding sample: this rank still takes the step
            kept.append(real.tolist())
        if not self.pad:
            kept = [indices for indices in kept if indices]
        self._batches.batches = kept
        batches = (self._cut(torch.tensor(ids), self.device) for ids in kept) if self._cut else self.loader
        for offset, data in enumerate(batches):
            index = start + offset
            self.real_count = planned[offset].real_count if self.pad else len(kept[offset])
            self.batch_in_epoch = index + 1
            if self.on_batch is not None:
                closes = (index + 1) % self.grad_accum == 0 or index + 1 == steps
                self.on_batch(DrawnBatch(self.real_count, totals[offset], closes))
            yield to_device(data, self.device)
        self.epoch, self.batch_in_epoch = epoch + 1, 0
        self._next_start = (epoch + 1, 0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "global_batch": self.plan.batch_size * self.plan.world_size, "num_samples": self.plan.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume mid-epoch where the global batch is the same (the same samples come next on any world
        size); otherwise at the start of the next epoch, with a warning."""
        epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
        same = (state.get("global_batch") == self.plan.batch_size * self.plan.world_size
                and state.get("num_samples") == self.plan.num_samples)
        if batch and not same:
            if self.plan.rank == 0:
                warnings.warn(f"the loader resumes at the start of epoch {epoch + 1}: the checkpoint's global "
                              f"batch was {state.get('global_batch')} samples, now it is "
                              f"{self.plan.batch_size * self.plan.world_size}; the rest of epoch {epoch} is "
                              "skipped (keep batch_size x world_size to resume mid-epoch)", stacklevel=2)
            epoch, batch = epoch + 1, 0
        self.epoch, self.batch_in_epoch = epoch, batch
        self._next_start = (epoch, batch)


def to_device(data: Any, device: torch.device) -> Any:
    """Tensors in ``data`` (nested tuples, lists and dicts) on ``device``; everything else as it is."""
    if device.type == "cpu":
        return data
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, (list, tuple)):
        moved = [to_device(item, device) for item in data]
        return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)
    if isinstance(data, dict):
        return type(data)({key: to_device(value, device) for key, value in data.items()})
    return data


def _array_cutter(dataset: ArrayDataset) -> Callable[[torch.Tensor, torch.device], Any]:
    return lambda indices, device: list(dataset.get_batch(indices, device))


def _tensor_cutter(dataset: TensorDataset) -> Callable[[torch.Tensor, torch.device], Any]:
    def cut(indices: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
        return [tensor[indices] for tensor in dataset.tensors]  # a list, as the DataLoader collates tuples
    return cut
