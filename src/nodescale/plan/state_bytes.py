"""Bytes of parameters, gradients and optimiser state per rank, by arithmetic over parameter shapes.

The figures are what ``strategies.footprint`` (and DeepSpeed's ``footprint``) measure on a live run
before an optimiser step, the largest rank's; ``tests/test_plan_state_bytes.py`` holds them to 2%.
What each strategy keeps, as its code does it:

* DDP: every rank the whole model, its gradients (DDP's buckets) and optimiser state.
* FSDP2: each parameter split along dim 0 in ``ceil(dim0 / n)`` rows per rank (rank 0 holds the
  most), over every rank (full, grad-op) or the ranks of a node (hybrid); gradients and optimiser
  state likewise; one scalar ``step`` per parameter for Adam.
* ZeRO-1/2: the parameters whole in one flat buffer padded to ``2 * n`` elements; each rank owns a
  slice of it, for which it keeps an fp32 master copy and the optimiser state (one ``step``). Its
  gradients are kept whole for every parameter that reaches into its slice (DeepSpeed 0.19's
  contiguous buffer), plus the padding.
* ZeRO-3: ``ceil(numel / n)`` of each parameter, and whole copies of the parameters of at most
  ``stage3_param_persistence_threshold`` elements (DeepSpeed keeps those on every rank); gradients and the fp32
  master and optimiser state of its partitions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from math import ceil, prod

from nodescale.plan.options import StrategyOption

PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
ZERO_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: the flat buffer is padded to 2 * ranks
FP32 = 4


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds for training state, by kind (and what offload moves to host memory)."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    host_bytes: int = 0  # moved to host memory by CPU offload (not counted above)

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class Optimiser:
    """How much state an optimiser keeps per parameter element."""

    states: int  # fp32 tensors shaped like each parameter (Adam: 2, SGD with momentum: 1)
    step_tensors: bool  # a scalar fp32 ``step`` per parameter tensor (Adam, AdamW)

    @classmethod
    def named(cls, name: str, momentum: float = 0.9) -> Optimiser:
        """The optimiser of ``optim.name`` (adamw, adam, sgd)."""
        if name in ("adamw", "adam"):
            return cls(2, True)
        return cls(1 if momentum > 0 else 0, False)


def _rows_per_rank(shape: Sequence[int], ranks: int) -> int:
    """Elements of FSDP2's largest shard of a parameter of ``shape`` over ``ranks``."""
    if not shape:
        return 1
    return ceil(shape[0] / ranks) * prod(shape[1:])


def fsdp_state(shapes: Sequence[Sequence[int]], shard_ranks: int, optimiser: Optimiser) -> StateBytes:
    """FSDP2 sharding over ``shard_ranks`` (1: every rank keeps everything, as DDP)."""
    local = sum(_rows_per_rank(shape, shard_ranks) for shape in shapes)
    steps = FP32 * len(shapes) if optimiser.step_tensors else 0
    return StateBytes(FP32 * local, FP32 * local, FP32 * local * optimiser.states + steps)


def zero12_state(numels: Sequence[int], ranks: int, stage: int, optimiser: Optimiser,
                 param_bytes: int = FP32) -> StateBytes:
    """ZeRO-1/2 (DeepSpeed's stage_1_and_2) over ``ranks``; the largest rank's gradient buffer."""
    total = sum(numels)
    align = ZERO_ALIGNMENT * ranks
    padded = ceil(total / align) * align
    part = padded // ranks
    gradients = _largest_reach(numels, part, ranks)
    gradients += padded - total  # the padding, kept as a gradient of its own on the last rank
    if ranks == 1 or stage == 0:
        gradients = total
    steps = FP32 if optimiser.step_tensors else 0
    return StateBytes(param_bytes * padded, param_bytes * gradients,
                      FP32 * part * (1 + optimiser.states) + steps)


def _largest_reach(numels: Sequence[int], part: int, ranks: int) -> int:
    """The most elements any rank keeps: the parameters whose slice of the flat buffer overlaps its own."""
    added = [0] * (ranks + 1)  # a difference array over ranks: one pass, however many ranks
    offset = 0
    for numel in numels:
        if numel:
            first, last = offset // part, min((offset + numel - 1) // part, ranks - 1)
            added[first] += numel
            added[last + 1] -= numel
        offset += numel
    most = running = 0
    for rank in range(ranks):
        running += added[rank]
        most = max(most, running)
    return most


def zero3_state(numels: Sequence[int], ranks: int, optimiser: Optimiser, param_bytes: int = FP32,
                persistence_threshold: int = PERSISTENCE_THRESHOLD) -> StateBytes:
    """ZeRO-3 over ``ranks``: partitions of every parameter, whole copies of the small ones."""
    part = sum(ceil(numel / ranks) for numel in numels)
    persistent = sum(numel for numel in numels if numel <= persistence_threshold)
    steps = FP32 if optimiser.step_tensors else 0
    return StateBytes(param_bytes * (part + persistent), param_bytes * part,
                      FP32 * part * (1 + optimiser.states) + steps)


def state_bytes(option: StrategyOption, shapes: Sequence[Sequence[int]], world_size: int, ranks_per_node: int,
                optimiser: Optimiser, precision: str = "fp32",
                persistence_threshold: int = PERSISTENCE_THRESHOLD) -> StateBytes:
    """What one rank holds under ``option`` for parameters of ``shapes`` on ``world_size`` ranks.

    Torch-native strategies keep fp32 parameters under autocast; DeepSpeed keeps them in bf16/fp16
    (with an fp32 master copy in the optimiser) when the run is in that precision.
    ``persistence_threshold``: ZeRO-3's ``stage3_param_persistence_threshold``.
    """
    numels = [prod(shape) for shape in shapes]
    ds_param = 2 if precision in ("bf16", "fp16") else FP32
    if option.family == "ddp":
        held = fsdp_state(shapes, 1, optimiser)
    elif option.family == "fsdp":
        ranks = min(ranks_per_node, world_size) if option.sharding == "hybrid" else world_size
        held = fsdp_state(shapes, ranks, optimiser)
    elif option.stage == 3:
        held = zero3_state(numels, world_size, optimiser, ds_param, persistence_threshold)
    else:
        held = zero12_state(numels, world_size, option.stage, optimiser, ds_param)
    return _offloaded(held, option)


def _offloaded(held: StateBytes, option: StrategyOption) -> StateBytes:
    """``held`` with what CPU offload moves to host memory taken off the GPU."""
    if option.offload == "all":  # FSDP: parameters, gradients, optimiser; ZeRO-3: parameters and optimiser
        moved = held.total_bytes if option.family == "fsdp" else held.parameter_bytes + held.optimizer_bytes
        kept_grads = 0 if option.family == "fsdp" else held.gradient_bytes
        return StateBytes(0, kept_grads, 0, moved)
    if option.offload == "optimizer":
        return StateBytes(held.parameter_bytes, held.gradient_bytes, 0, held.optimizer_bytes)
    return held
