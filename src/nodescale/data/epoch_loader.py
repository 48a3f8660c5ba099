"""The one loader of both faces: a ``ShardPlan`` dealt through a ``DataLoader``, every sample exactly once.

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

In-memory arrays (nodescale's ``WholeBatchDataset``: ``ArrayDataset``, ``TokenWindows``;
and a ``TensorDataset``) are cut a whole batch at a time; nodescale's live on the
accelerator when they fit, so a step costs no host work. Other datasets go through the
``DataLoader`` and its workers.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from nodescale.data.arrays import WholeBatchDataset, copy_to_device
from nodescale.data.decoded_batches import BatchesRead, reads_batches, whole_batch
from nodescale.data.sharding import ShardPlan, window_totals
from nodescale.errors import UserError

# Arrays up to this size are moved to the accelerator once, so batches are cut on the
# device with no host work per step (digits, MNIST, CIFAR-10 all fit).
RESIDENT_BYTES = 2 * 1024**3


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
                 channels_last: bool = False, clock: Callable[[], float] | None = None,
                 decode: Callable[[Any], Any] | None = None, augment: Callable[..., torch.Tensor] | None = None,
                 **loader_options: Any) -> None:
        self.plan = plan
        self.pad = pad  # keep every rank at the same step count (training); False: evaluation shards
        self.drop_last = drop_last
        self.grad_accum = grad_accum
        self.device = device
        self.on_batch = on_batch
        self.channels_last = channels_last  # 4-D inputs in channels_last layout (stored so when resident)
        self.clock = clock or time.perf_counter  # the run's training time: saves and evaluation left out
        self.decode = decode  # a batch as the workers left it -> its inputs decoded on the device (--decode gpu)
        self.augment = augment  # (inputs, epoch, indices) -> augmented inputs, on the device
        self.epoch = 0
        self.batch_in_epoch = 0  # batches of this epoch already drawn: the resume point
        # Where the next iteration starts: an epoch's end, a loaded position or set_epoch. An iteration
        # left unfinished (a peek with next(iter(loader)), a break) is begun again from there.
        self._next_start = (0, 0)
        self.real_count = 0  # real samples in the batch drawn last
        self.wait_seconds = 0.0  # time the loop waited for batches (loading, collation, the copy to the device)
        self.epoch_seconds: list[float] = []  # training time of each whole epoch (begun at its first batch)
        self.last_epoch_seconds: float | None = None  # of the epoch (or its resumed part) ended last
        if isinstance(dataset, WholeBatchDataset) and device.type != "cpu" and dataset.nbytes <= RESIDENT_BYTES:
            dataset = dataset.to(device, channels_last=channels_last)
        self._dataset = dataset
        self._batches = PlannedBatches()
        loader_options.setdefault("pin_memory", device.type == "cuda")
        # Tensors in memory are cut a whole batch at a time: the same values as the DataLoader's
        # per-sample collation, without a Python call per sample (a plain TensorDataset's options
        # beyond pin_memory would change what it yields, so they keep the DataLoader).
        plain = set(loader_options) <= {"pin_memory"}
        self._cut = (_array_cutter(dataset, device) if isinstance(dataset, WholeBatchDataset)
                     else _tensor_cutter(dataset) if isinstance(dataset, TensorDataset) and plain else None)
        if reads_batches(dataset) and "collate_fn" not in loader_options:  # decoded into one batch, not stacked
            dataset, loader_options["collate_fn"] = BatchesRead(dataset), whole_batch
        self.loader = DataLoader(dataset, batch_sampler=self._batches, **loader_options)

    @property
    def sampler(self) -> PlannedBatches:  # the old EpochLoader's attribute
        return self._batches

    @property
    def dataset(self) -> Dataset:
        return self._dataset

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
        began = self.clock()
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
            kept.append(real)
        if not self.pad:
            kept = [indices for indices in kept if len(indices)]
        if self._cut is not None:
            batches: Iterator[Any] = map(self._cut, _indices_on(self.dataset, kept))
        else:
            keyed = getattr(self.dataset, "keyed_by_epoch", False)  # augmenting in the workers needs the epoch
            self._batches.batches = [[(epoch, i) for i in indices.tolist()] if keyed else indices.tolist()
                                     for indices in kept]
            batches = iter(self.loader)
        for offset in range(len(kept)):
            waited = time.perf_counter()
            data = _from_workers(batches)
            if self.decode is not None:
                data = self.decode(data)
            data = to_device(data, self.device)
            if self.augment is not None:
                data[0] = self.augment(data[0], epoch, kept[offset])
            data = self._shaped(data)
            self.wait_seconds += time.perf_counter() - waited
            index = start + offset
            self.real_count = planned[offset].real_count if self.pad else len(kept[offset])
            self.batch_in_epoch = index + 1
            if self.on_batch is not None:
                closes = (index + 1) % self.grad_accum == 0 or index + 1 == steps
                self.on_batch(DrawnBatch(self.real_count, totals[offset], closes))
            try:
                yield data
            except GeneratorExit:  # a break: after the epoch's last batch, the epoch is still done
                if index + 1 == steps:
                    self._end_epoch(epoch, start, began)
                raise
        self._end_epoch(epoch, start, began)

    def _end_epoch(self, epoch: int, start: int, began: float) -> None:
        self.last_epoch_seconds = self.clock() - began
        if start == 0:  # an epoch resumed half-way is not a whole epoch's time
            self.epoch_seconds.append(self.last_epoch_seconds)
        self.epoch, self.batch_in_epoch = epoch + 1, 0
        self._next_start = (epoch + 1, 0)

    def _shaped(self, data: Any) -> Any:
        # A copy only for batches not cut from a channels_last store (a no-op for those).
        if self.channels_last and isinstance(data, list) and data and getattr(data[0], "ndim", 0) == 4:
            data[0] = data[0].contiguous(memory_format=torch.channels_last)
        return data

    def close(self) -> None:
        """Stop the DataLoader's workers now, while the process can still tell them to. Left to the exit,
        persistent workers beside a pin-memory thread (any CUDA run) can each cost a 5 s join timeout in
        torch's own clean-up (pytorch/pytorch#81794)."""
        iterator, self.loader._iterator = self.loader._iterator, None
        if hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "global_batch": self.plan.batch_size * self.plan.world_size, "num_samples": self.plan.num_samples,
                "world_size": self.plan.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume mid-epoch where the global batch is the same (the same samples come next on any world
        size; for tar shards, whose pieces are per rank, on the same world size); otherwise at the start
        of the next epoch, with a warning."""
        epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
        same = (state.get("global_batch") == self.plan.batch_size * self.plan.world_size
                and state.get("num_samples", self.plan.num_samples) == self.plan.num_samples
                and (not self.plan.groups or state.get("world_size") == self.plan.world_size))
        if batch and not same:
            if self.plan.rank == 0:
                warnings.warn(f"the loader resumes at the start of epoch {epoch + 1}: the checkpoint's global "
                              f"batch was {state.get('global_batch')} samples, now it is "
                              f"{self.plan.batch_size * self.plan.world_size} (on {state.get('world_size')} ranks, now "
                              f"{self.plan.world_size}); the rest of epoch {epoch} is "
                              "skipped (keep batch_size x world_size to resume mid-epoch)", stacklevel=2)
            epoch, batch = epoch + 1, 0
        self.epoch, self.batch_in_epoch = epoch, batch
        self._next_start = (epoch, batch)


class PlannedBatches:
    """A batch sampler whose batches are set per epoch (works with persistent workers)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _from_workers(batches: Iterator[Any]) -> Any:
    """The next batch; a ``UserError`` raised in a DataLoader worker stays one (exit code 2, no traceback).

    The DataLoader re-raises a worker's exception by calling its type with one message, which
    ``UserError`` does not take: it would become a RuntimeError holding the worker's traceback.
    """
    try:
        return next(batches)
    except RuntimeError as err:
        text = str(err)
        if not text.startswith("Caught UserError"):
            raise
        message = text.rstrip().rsplit("UserError: ", 1)[-1]
        what_rule, _, hint = message.partition("\n  hint: ")
        what, _, rule = what_rule.partition(": ")
        raise UserError(what, rule, hint or None) from None


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


def _array_cutter(dataset: WholeBatchDataset, device: torch.device) -> Callable[[torch.Tensor], Any]:
    return lambda indices: list(dataset.get_batch(indices, device))  # pinned and copied without blocking


def _tensor_cutter(dataset: TensorDataset) -> Callable[[torch.Tensor], Any]:
    def cut(indices: torch.Tensor) -> list[torch.Tensor]:
        return [tensor[indices] for tensor in dataset.tensors]  # a list, as the DataLoader collates tuples
    return cut


def _indices_on(dataset: Any, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each batch's sample indices where the arrays are, moved there in one copy for the whole epoch.

    Indexing a CUDA tensor with CPU indices copies them with a blocking copy, which waits for
    every queued kernel: one host synchronisation per step, and the GPU idles while Python
    queues the next step. One pinned, non-blocking copy per epoch keeps the steps free of it.
    """
    if isinstance(dataset, TensorDataset):
        device = dataset.tensors[0].device if dataset.tensors else torch.device("cpu")
    else:
        device = dataset.storage_device
    if device.type == "cpu" or not batches:
        return batches
    on_device = copy_to_device(torch.cat(batches), device)
    return list(on_device.split([len(indices) for indices in batches]))
