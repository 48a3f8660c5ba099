"""The sharding plan: every sample exactly once per epoch, equal steps on every rank."""

from __future__ import annotations

import pytest
import torch

from nodescale.data.sharding import ShardPlan, grouped_order, window_totals


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


def _grouped_epoch(groups: tuple[int, ...], world: int, batch: int, epoch: int) -> list[list[int]]:
    """The real sample indices each rank sees in ``epoch`` of a plan whose samples are read in ``groups``."""
    seen = []
    for rank in range(world):
        plan = ShardPlan(sum(groups), world, rank, batch, seed=3, groups=groups)
        seen.append([int(i) for b in plan.batches(epoch) for i, w in zip(b.indices, b.weights, strict=True) if w > 0])
    return seen


@pytest.mark.parametrize("groups,world,batch", [((4,) * 25, 1, 7), ((4,) * 25, 2, 8), ((5, 3, 8, 1, 9, 4), 3, 2),
                                                ((2, 2, 1), 4, 1), ((16,) * 9 + (7,), 3, 5)])
def test_grouped_plan_sees_every_sample_once_and_each_group_in_one_stretch(groups, world, batch) -> None:
    group_of = [g for g, size in enumerate(groups) for _ in range(size)]
    orders = []
    for epoch in range(3):
        seen = _grouped_epoch(groups, world, batch, epoch)
        assert sorted(i for rank in seen for i in rank) == list(range(sum(groups)))
        for rank in seen:  # a rank's samples of one group come one after another: the group is read once
            stretches = [group_of[i] for k, i in enumerate(rank) if k == 0 or group_of[rank[k - 1]] != group_of[i]]
            assert len(stretches) == len(set(stretches)), f"a group read twice by one rank: {stretches}"
        # Ranks deal contiguous runs: only the world_size - 1 groups at their borders are read by two ranks.
        assert sum(len({group_of[i] for i in rank}) for rank in seen) <= len(groups) + world - 1
        orders.append(seen)
    assert orders[0] != orders[1]  # a new order each epoch


def test_grouped_order_shuffles_groups_and_their_samples() -> None:
    order = grouped_order((10,) * 10, seed=1).tolist()
    assert [i // 10 for i in order[::10]] != list(range(10))  # the groups are reordered
    assert order[:10] != sorted(order[:10]) and sorted(order[:10]) == list(range(order[0] // 10 * 10,
                                                                              order[0] // 10 * 10 + 10))
    assert grouped_order((10,) * 10, seed=1, shuffle=False).tolist() == list(range(100))


def test_a_grouped_plan_resumes_mid_epoch_only_on_the_same_world_size() -> None:
    from torch.utils.data import TensorDataset

    from nodescale.data.epoch_loader import EpochLoader

    def loader(world: int, batch: int, groups: tuple[int, ...] | None) -> EpochLoader:
        plan = ShardPlan(40, world, 0, batch, groups=groups)
        return EpochLoader(TensorDataset(torch.arange(40)), plan, pad=True, drop_last=False, grad_accum=1,
                           device=torch.device("cpu"))

    saved = {**loader(2, 4, (4,) * 10).state_dict(), "epoch": 1, "batch_in_epoch": 3}
    same = loader(2, 4, (4,) * 10)
    same.load_state_dict(saved)
    assert (same.epoch, same.batch_in_epoch) == (1, 3)
    with pytest.warns(UserWarning, match="and the world size for chunked data"):
        other = loader(1, 8, (4,) * 10)  # the same global batch, but another dealing of the groups
        other.load_state_dict(saved)
    assert (other.epoch, other.batch_in_epoch) == (2, 0)
    ungrouped = loader(1, 8, None)  # without groups the same global batch resumes on any world size
    ungrouped.load_state_dict(saved)
    assert (ungrouped.epoch, ungrouped.batch_in_epoch) == (1, 3)
