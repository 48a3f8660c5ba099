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

Samples read together (the chunks of a Zarr store: ``groups``, the sizes of consecutive
index runs) are ordered group by group instead: a seeded order of the groups, a seeded
order inside each, and each rank deals a contiguous run of that sequence, so a rank
reads each group at most once per epoch (``grouped_order``, ``dealt_runs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    """One rank's share of one step."""

    indices: torch.Tensor  # int64 sample indices (padding repeats real ones)
    weights: torch.Tensor  # float32, 1 for real samples, 0 for padding
    global_count: int  # real samples in this step across all ranks
    real_count: int  # real samples of this rank in this step


@dataclass(frozen=True)
class ShardPlan:
    """The batches of one rank for any epoch, computed without communication."""

    num_samples: int
    world_size: int
    rank: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    groups: tuple[int, ...] | None = None  # sizes of consecutive index runs read together (chunks)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError("a plan needs at least one sample")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.batch_size < 1:
            raise ValueError("batch_size must be positive")
        if self.groups is not None and sum(self.groups) != self.num_samples:
            raise ValueError(f"groups hold {sum(self.groups)} samples, not {self.num_samples}")

    @property
    def shard_size(self) -> int:
        """Positions per rank, padding included (the same on every rank)."""
        return math.ceil(self.num_samples / self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.shard_size / self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's global order of sample indices, before padding."""
        if self.groups is not None:
            return dealt_runs(grouped_order(self.groups, self.seed + epoch, self.shuffle), self.world_size)
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def batches(self, epoch: int, start_step: int = 0) -> list[Batch]:
        """This rank's batches of ``epoch``, from ``start_step`` on (for resuming)."""
        order = self.order(epoch)
        padded_length = self.shard_size * self.world_size
        # Pad by wrapping around the order, as DistributedSampler does, so the
        # padding is made of real samples that BatchNorm can digest.
        repeats = math.ceil(padded_length / self.num_samples)
        padded = order.repeat(repeats)[:padded_length]
        positions = torch.arange(self.rank, padded_length, self.world_size)
        batches = []
        for step in range(start_step, self.steps_per_epoch):
            shard_slice = positions[step * self.batch_size:(step + 1) * self.batch_size]
            first, last = int(shard_slice[0]) // self.world_size, int(shard_slice[-1]) // self.world_size
            real = shard_slice < self.num_samples
            batches.append(Batch(
                indices=padded[shard_slice],
                weights=real.to(torch.float32),
                global_count=self._real_in_rows(first, last + 1),
                real_count=int(real.sum()),
            ))
        return batches

    def _real_in_rows(self, first_row: int, end_row: int) -> int:
        # Rows of the padded order hold world_size positions each; positions
        # below num_samples are real.
        start, end = first_row * self.world_size, end_row * self.world_size
        return max(0, min(end, self.num_samples) - start)


def grouped_order(groups: tuple[int, ...], seed: int, shuffle: bool = True) -> torch.Tensor:
    """Sample indices group by group: the groups (consecutive index runs of these sizes) in an order
    drawn from ``seed``, the samples inside each in an order drawn from it too (in index order without
    ``shuffle``)."""
    total = sum(groups)
    if not shuffle:
        return torch.arange(total)
    generator = torch.Generator().manual_seed(seed)
    place = torch.empty(len(groups), dtype=torch.float64)
    place[torch.randperm(len(groups), generator=generator)] = torch.arange(len(groups), dtype=torch.float64)
    # A sample's key: its group's place, plus a random fraction that orders it inside the group.
    keys = place.repeat_interleave(torch.tensor(groups)) + torch.rand(total, generator=generator, dtype=torch.float64)
    return torch.argsort(keys, stable=True)


def dealt_runs(sequence: torch.Tensor, world_size: int) -> torch.Tensor:
    """``sequence`` laid out so that rank r's interleaved positions (r, r + W, ...) hold a contiguous run of it.

    Rank r gets as many real samples as the interleaving gives it (the first N mod W ranks one more),
    so the padding and counts of ``ShardPlan.batches`` stay as they are.
    """
    n = len(sequence)
    base, extra = divmod(n, world_size)
    positions = torch.arange(n)
    rank, row = positions % world_size, positions // world_size
    return sequence[rank * base + rank.clamp(max=extra) + row]


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
