"""The sharding plan: every sample exactly once per epoch, equal steps on every rank."""

from __future__ import annotations

import pytest
import torch

from nodescale.data.sharding import ShardPlan, window_totals


def _epoch_samples(n: int, world: int, batch: int, epoch: int, seed: int = 0) -> list[list[int]]:
    """The real sample indices each rank sees in ``epoch``."""
    seen = []
    for rank in range(world):
        plan = ShardPlan(n, world, rank, batch, seed)
        seen.append([int(i) for b in plan.batches(epoch) for i, w in zip(b.indices, b.weights, strict=True) if w > 0])
    return seen


@pytest.mark.parametrize("n,world,batch", [(100, 1, 7), (100, 2, 8), (101, 2, 8), (97, 4, 5), (10, 4, 2),
                                           (3, 4, 1), (1437, 2, 32)])
def test_every_sample_exactly_once_per_epoch(n: int, world: int, batch: int) -> None:
    for epoch in range(3):
        seen = [i for rank in _epoch_samples(n, world, batch, epoch) for i in rank]
        assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("n,world,batch", [(101, 2, 8), (97, 4, 5), (10, 4, 3), (3, 4, 1)])
def test_ranks_run_equal_steps_of_equal_size(n: int, world: int, batch: int) -> None:
    plans = [ShardPlan(n, world, rank, batch) for rank in range(world)]
    per_rank = [plan.batches(0) for plan in plans]
    assert len({len(batches) for batches in per_rank}) == 1
    for step in range(len(per_rank[0])):
        sizes = {len(batches[step].indices) for batches in per_rank}
        assert len(sizes) == 1, f"step {step} sizes differ: {sizes}"
        real = sum(int(batches[step].weights.sum()) for batches in per_rank)
        assert all(batches[step].global_count == real for batches in per_rank)


def test_order_changes_by_epoch_and_is_identical_across_ranks() -> None:
    first = _epoch_samples(64, 2, 8, epoch=0)
    second = _epoch_samples(64, 2, 8, epoch=1)
    assert first != second
    assert first == _epoch_samples(64, 2, 8, epoch=0)  # same seed and epoch: same order, on any rank


def test_one_rank_batch_b_equals_two_ranks_batch_half() -> None:
    # The union of what 2 ranks see at a step is what 1 rank sees with twice the batch:
    # the basis of DDP == single-process equivalence.
    one = ShardPlan(64, 1, 0, 16).batches(2)
    two = [ShardPlan(64, 2, rank, 8).batches(2) for rank in range(2)]
    for step, batch in enumerate(one):
        union = torch.cat([two[0][step].indices, two[1][step].indices])
        assert sorted(batch.indices.tolist()) == sorted(union.tolist())


def test_resume_start_step_skips_consumed_batches() -> None:
    plan = ShardPlan(100, 2, 1, 8)
    full = plan.batches(4)
    tail = plan.batches(4, start_step=3)
    assert [b.indices.tolist() for b in tail] == [b.indices.tolist() for b in full[3:]]


def test_unshuffled_plan_is_in_order() -> None:
    plan = ShardPlan(10, 2, 0, 3, shuffle=False)
    assert [i for b in plan.batches(0) for i in b.indices.tolist()] == [0, 2, 4, 6, 8]


def test_accumulationwindow_totals() -> None:
    assert window_totals([4, 4, 4, 4, 3], start=0, accum=2) == [8, 8, 8, 8, 3]
    assert window_totals([4, 4, 3], start=2, accum=2) == [8, 8, 3]
    assert window_totals([4, 4, 4], start=1, accum=2) == [4, 8, 8]
    assert window_totals([5, 5], start=0, accum=1) == [5, 5]


def _grouped_epoch(groups: tuple[int, ...], world: int, batch: int, epoch: int, shuffle: bool = True,
                   unreadable: frozenset[int] = frozenset()) -> list[list[int]]:
    seen = []
    for rank in range(world):
        plan = ShardPlan(sum(groups), world, rank, batch, 5, shuffle, groups, unreadable)
        seen.append([int(i) for b in plan.batches(epoch) for i, w in zip(b.indices, b.weights, strict=True) if w > 0])
    return seen


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("groups", [(10, 10, 10, 7), (1,) * 5, (40,), (3, 9, 1, 14, 2)])
def test_shards_every_sample_once_per_epoch_and_each_rank_reads_few_shards(world: int, groups: tuple[int, ...]) -> None:
    starts = [sum(groups[:i]) for i in range(len(groups))]
    shard_of = {index: s for s, start in enumerate(starts) for index in range(start, start + groups[s])}
    epochs = [_grouped_epoch(groups, world, 4, epoch) for epoch in range(3)]
    for seen in epochs:
        assert sorted(i for rank in seen for i in rank) == list(range(sum(groups)))
        # each rank reads a contiguous piece of the shards: only where two pieces meet is a shard shared
        readers = [sum(s in {shard_of[i] for i in rank} for rank in seen) for s in range(len(groups))]
        assert sum(r - 1 for r in readers) <= world - 1
    # the shards of a rank stay the same from epoch to epoch (they can be staged); the order changes
    assert all({shard_of[i] for i in epochs[0][r]} == {shard_of[i] for i in epochs[2][r]} for r in range(world))
    if sum(groups) > 5:
        assert epochs[0] != epochs[1]


def test_shards_order_is_shards_then_positions_and_sequential_is_stored() -> None:
    assert _grouped_epoch((4, 3, 5), 1, 5, 0, shuffle=False) == [list(range(12))]
    shard_orders, inside = set(), set()
    for epoch in range(4):
        order = _grouped_epoch((4, 3, 5), 1, 5, epoch)[0]
        shards = [(i >= 4) + (i >= 7) for i in order]
        runs = [shards[0]] + [b for a, b in zip(shards, shards[1:], strict=False) if a != b]
        assert sorted(runs) == [0, 1, 2]  # each shard read whole before the next: no shuffle buffer
        shard_orders.add(tuple(runs))
        inside.add(tuple(i for i in order if i < 4))
    assert len(shard_orders) > 1 and len(inside) > 1  # both drawn anew each epoch


def test_unreadable_samples_weigh_zero_on_every_rank_and_keep_the_steps() -> None:
    groups, bad = (6, 6, 5), frozenset({6, 7, 8, 9, 10, 11})
    seen = _grouped_epoch(groups, 2, 3, 0, unreadable=bad)
    assert sorted(i for rank in seen for i in rank) == sorted(set(range(17)) - bad)
    plans = [ShardPlan(17, 2, rank, 3, 5, True, groups, bad) for rank in range(2)]
    steps = [plan.batches(0) for plan in plans]
    assert len(steps[0]) == len(steps[1]) == ShardPlan(17, 2, 0, 3).steps_per_epoch
    for one, two in zip(*steps, strict=True):
        assert one.global_count == two.global_count == one.real_count + two.real_count


def test_a_grouped_plan_resumes_mid_epoch_only_on_the_same_world_size() -> None:
    from torch.utils.data import TensorDataset

    from nodescale.data.epoch_loader import EpochLoader

    def loader(world: int, batch: int, groups: tuple[int, ...]) -> EpochLoader:
        plan = ShardPlan(40, world, 0, batch, groups=groups)
        return EpochLoader(TensorDataset(torch.arange(40)), plan, pad=True, drop_last=False, grad_accum=1,
                           device=torch.device("cpu"))

    saved = {**loader(2, 4, (4,) * 10).state_dict(), "epoch": 1, "batch_in_epoch": 3}
    same = loader(2, 4, (4,) * 10)
    same.load_state_dict(saved)
    assert (same.epoch, same.batch_in_epoch) == (1, 3)
    with pytest.warns(UserWarning, match=r"on 2 ranks, now 1"):
        other = loader(1, 8, (4,) * 10)  # the same global batch, but other pieces of the groups
        other.load_state_dict(saved)
    assert (other.epoch, other.batch_in_epoch) == (2, 0)
    ungrouped = loader(1, 8, ())  # without groups the same global batch resumes on any world size
    ungrouped.load_state_dict(saved)
    assert (ungrouped.epoch, ungrouped.batch_in_epoch) == (1, 3)
