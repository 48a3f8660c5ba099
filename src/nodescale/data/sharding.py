"""Which samples each rank processes at each step: every sample exactly once per epoch.

``torch.utils.data.DistributedSampler`` pads the epoch with duplicated samples
(or drops the tail) so that ranks get equal shards. Duplicates bias the loss
and the validation accuracy; dropping loses data. This plan pads too, so that
every rank runs the same number of equally sized batches (DDP and FSDP need
that), but marks the padding with weight 0, and tells the loop how many real
samples the whole step holds across all ranks. The loss
``sum(weight * per_sample_loss) * world_size / global_count`` averaged by DDP
is then exactly the mean over the real samples of the global batch, and the
validation metrics count each sample once.

The order is a permutation drawn from ``seed + epoch`` (a new order each
epoch, identical on every rank); rank ``r`` takes positions ``r, r + W, ...``
of the padded permutation, the same interleaving ``DistributedSampler`` uses.

Datasets stored in runs (tar shards, a Zarr store's blocks of chunks: ``groups`` gives the run
lengths) are dealt so that a rank reads few runs: the runs, in an order drawn from ``seed`` alone
(fixed across epochs, so a rank's files can be staged to node-local disk), are cut into one
contiguous piece per rank; each epoch shuffles the order of a rank's runs and the positions inside
each. ``unreadable``
samples (a damaged shard kept at its manifest's count) always weigh 0, on every rank alike.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Batch:
    """One rank's share of one step."""

    indices: torch.Tensor  # int64 sample indices (padding repeats real ones)
    weights: torch.Tensor  # float32, 1 for real samples, 0 for padding
    global_count: int  # real samples in this step across all ranks
    real_count: int  # real samples of this rank in this step


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of ``epoch``'s order: ``seed + epoch``, wrapped into the 64 bits torch's generators take
    (the largest seed, 2**64-1, goes on at 0 in epoch 1)."""
    return (seed + epoch) % 2**64


@dataclass(frozen=True)
class ShardPlan:
    """The batches of one rank for any epoch, computed without communication."""

    num_samples: int
    world_size: int
    rank: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    groups: tuple[int, ...] = ()  # lengths of consecutive index runs stored together (shards); () for none
    unreadable: frozenset[int] = frozenset()  # indices that always weigh 0

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError("a plan needs at least one sample")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.batch_size < 1:
            raise ValueError("batch_size must be positive")
        if self.groups and sum(self.groups) != self.num_samples:
            raise ValueError(f"groups hold {sum(self.groups)} samples, not {self.num_samples}")

    @classmethod
    def for_dataset(cls, dataset: Any, world_size: int, rank: int, batch_size: int, seed: int,
                    shuffle: bool = True) -> ShardPlan:
        """The plan of ``dataset``. Data read in runs (tar shards, Zarr chunks) says so (``sample_groups``),
        so that each rank reads few runs; samples of a damaged shard (``unreadable``) weigh 0."""
        return cls(len(dataset), world_size, rank, batch_size, seed, shuffle,
                   tuple(getattr(dataset, "sample_groups", ())), frozenset(getattr(dataset, "unreadable", ())))

    @property
    def shard_size(self) -> int:
        """Positions per rank, padding included (the same on every rank)."""
        return math.ceil(self.num_samples / self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.shard_size / self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's global order of sample indices, before padding (without ``groups``)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=generator)

    def padded(self, epoch: int) -> torch.Tensor:
        """The epoch's order padded to ``shard_size * world_size``: position ``p`` goes to rank ``p % W``."""
        padded_length = self.shard_size * self.world_size
        if self.groups:
            return self._grouped(epoch).T.reshape(-1)
        # Pad by wrapping around the order, as DistributedSampler does, so the
        # padding is made of real samples that BatchNorm can digest.
        order = self.order(epoch)
        repeats = math.ceil(padded_length / self.num_samples)
        return order.repeat(repeats)[:padded_length]

    def _grouped(self, epoch: int) -> torch.Tensor:
        """(world_size, shard_size): each rank's positions, from its contiguous piece of the runs."""
        starts = [0, *itertools.accumulate(self.groups)][:-1]
        runs = [torch.arange(start, start + length) for start, length in zip(starts, self.groups, strict=True)]
        if self.shuffle:  # which runs a rank reads: from the seed alone, the same every epoch
            fixed = torch.Generator().manual_seed(epoch_seed(self.seed, 0))
            runs = [runs[i] for i in torch.randperm(len(runs), generator=fixed).tolist()]
        stored = torch.cat(runs)
        run_of = torch.repeat_interleave(torch.arange(len(self.groups)), torch.tensor(self.groups))
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        rows = torch.empty(self.world_size, self.shard_size, dtype=torch.int64)
        quotient, remainder = divmod(self.num_samples, self.world_size)
        begin = 0
        for rank in range(self.world_size):
            # Ranks below the remainder take one sample more: padding sits past num_samples, as without groups.
            count = quotient + (rank < remainder)
            piece = stored[begin:begin + count]
            if self.shuffle:
                piece = torch.cat(_shuffled_runs(piece, run_of[piece], generator)) if count else piece
            rows[rank, :count] = piece
            rows[rank, count:] = piece[0] if count else stored[0]  # padding, weighted 0
            begin += count
        return rows

    def batches(self, epoch: int, start_step: int = 0) -> list[Batch]:
        """This rank's batches of ``epoch``, from ``start_step`` on (for resuming)."""
        padded = self.padded(epoch)
        padded_length = len(padded)
        real = torch.arange(padded_length) < self.num_samples
        if self.unreadable:
            real &= ~torch.isin(padded, torch.tensor(sorted(self.unreadable), dtype=torch.int64))
        positions = torch.arange(self.rank, padded_length, self.world_size)
        row = self.world_size
        batches = []
        for step in range(start_step, self.steps_per_epoch):
            shard_slice = positions[step * self.batch_size:(step + 1) * self.batch_size]
            first, last = int(shard_slice[0]) // row, int(shard_slice[-1]) // row
            mine = real[shard_slice]
            batches.append(Batch(
                indices=padded[shard_slice],
                weights=mine.to(torch.float32),
                global_count=int(real[first * row:(last + 1) * row].sum()),  # the step's rows on all ranks
                real_count=int(mine.sum()),
            ))
        return batches


def _shuffled_runs(piece: torch.Tensor, run_of: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
    """``piece``'s runs (``run_of`` each index) in a drawn order, each with its positions drawn too."""
    breaks = (torch.nonzero(run_of[1:] != run_of[:-1]).flatten() + 1).tolist()
    runs = list(torch.tensor_split(piece, breaks))
    return [runs[i][torch.randperm(len(runs[i]), generator=generator)]
            for i in torch.randperm(len(runs), generator=generator).tolist()]


def window_totals(counts: list[int], start: int, accum: int) -> list[int]:
    """For each micro-batch from ``start``, the real-sample total of its accumulation window."""
    totals = []
    index = start
    end = start + len(counts)
    while index < end:
        window_end = min(end, (index // accum + 1) * accum)
        total = sum(counts[index - start:window_end - start])
        totals.extend([total] * (window_end - index))
        index = window_end
    return totals
