"""The plan's rows (one per strategy option), the recommendation, and the node count for a deadline.

Memory per rank is the state (``state_bytes``) plus the activations of one micro-batch plus the
parameters a sharded strategy gathers for its compute, against the GPU's memory less
``RESERVED_BYTES``. Time is steps x ``step_time``; the ``--time`` to ask for adds start-up,
checkpoint writes and a margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import ceil

from nodescale.errors import UserError
from nodescale.plan.hardware import Hardware
from nodescale.plan.model_facts import ModelFacts
from nodescale.plan.options import StrategyOption
from nodescale.plan.state_bytes import PERSISTENCE_THRESHOLD, Optimiser, StateBytes, state_bytes
from nodescale.plan.step_time import Layout, StepTime, step_time

RESERVED_BYTES = 1_000_000_000  # CUDA context, kernels and allocator slack: not the training's
STARTUP_S = 300.0  # queue-to-first-step: modules, imports, process group, data, the first compiled steps
CHECKPOINT_GBPS = 1.0  # per rank, to a parallel file system under load
MARGIN = 0.10  # on top of the estimate: it is a model, not a measurement
MAX_NODES = 1024


@dataclass(frozen=True)
class Workload:
    """What is to be trained, besides the model: samples, epochs, batches, precision, optimiser."""

    train_samples: int
    epochs: int
    max_steps: int | None
    grad_accum: int
    precision: str
    optimiser: Optimiser
    efficiency: float
    checkpoint_every: int  # steps between checkpoints (0: only at the end)
    persistence_threshold: int = PERSISTENCE_THRESHOLD  # ZeRO-3 keeps parameters this small whole


@dataclass(frozen=True)
class PlanRow:
    option: StrategyOption
    state: StateBytes
    activation_bytes: int
    gathered_bytes: int  # full parameters a sharded strategy holds while it computes
    usable_bytes: int
    step: StepTime
    steps: int
    global_batch: int
    checkpoint_s: float

    @property
    def total_bytes(self) -> int:
        return self.state.total_bytes + self.activation_bytes + self.gathered_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step.total_s

    @property
    def train_s(self) -> float:
        return self.steps * self.step.total_s

    @property
    def ask_s(self) -> float:
        """The wall time to ask the scheduler for: training, start-up, checkpoints and the margin."""
        return (self.train_s + self.checkpoint_s) * (1 + MARGIN) + STARTUP_S


def gathered_bytes(option: StrategyOption, facts: ModelFacts, precision: str) -> int:
    """Parameters gathered whole while computing: two FSDP units (one prefetched); grad-op keeps all."""
    element = 2 if precision in ("bf16", "fp16") else 4
    if option.family == "ddp" or (option.family == "zero" and option.stage < 3):
        return 0
    if option.sharding == "grad-op":
        return facts.parameter_count * element
    return 2 * max(facts.unit_parameters, default=0) * element


def plan_rows(facts: ModelFacts, hardware: Hardware, work: Workload, layout: Layout,
              options: Sequence[StrategyOption]) -> list[PlanRow]:
    """One row per option on ``layout``."""
    world = layout.world_size
    global_batch = facts.batch_size * work.grad_accum * world
    per_epoch = ceil(ceil(work.train_samples / world) / (facts.batch_size * work.grad_accum))
    steps = work.max_steps if work.max_steps is not None else per_epoch * work.epochs
    rows = []
    for option in options:
        held = state_bytes(replace(option, offload="none"), facts.shapes, world, layout.ranks_per_node,
                           work.optimiser, work.precision, work.persistence_threshold)
        state = state_bytes(option, facts.shapes, world, layout.ranks_per_node, work.optimiser, work.precision,
                            work.persistence_threshold)
        saves = 1 + (steps // work.checkpoint_every if work.checkpoint_every else 0)
        rows.append(PlanRow(
            option, state,
            facts.checkpointed_activation_bytes if option.checkpointing else facts.activation_bytes,
            gathered_bytes(option, facts, work.precision),
            hardware.memory_bytes - RESERVED_BYTES,
            step_time(option, facts, hardware, layout, work.precision, work.efficiency, work.grad_accum, held),
            steps, global_batch, saves * held.total_bytes / (CHECKPOINT_GBPS * 1e9),
        ))
    return rows


def recommend(rows: Sequence[PlanRow]) -> PlanRow | None:
    """The fastest row that fits (None: none fits)."""
    fitting = [row for row in rows if row.fits]
    return min(fitting, key=lambda row: row.step.total_s) if fitting else None


def nodes_for_deadline(deadline_s: float, facts: ModelFacts, hardware: Hardware, work: Workload,
                       ranks_per_node: int, options: Sequence[StrategyOption],
                       max_nodes: int = MAX_NODES) -> tuple[int, PlanRow]:
    """The fewest nodes whose recommended option's ``--time`` is within ``deadline_s``.

    ``UserError`` naming the best it gets when no node count up to ``max_nodes`` meets it.
    """
    def recommended(nodes: int) -> PlanRow | None:
        return recommend(plan_rows(facts, hardware, work, Layout(nodes, ranks_per_node), options))

    best: tuple[int, PlanRow] | None = None
    previous = 0
    for nodes in _node_counts(max_nodes):
        row = recommended(nodes)
        if row is not None and row.ask_s <= deadline_s:
            for fewer in range(previous + 1, nodes):  # the counts skipped between the two tried
                if (found := recommended(fewer)) is not None and found.ask_s <= deadline_s:
                    return fewer, found
            return nodes, row
        if row is not None and (best is None or row.ask_s < best[1].ask_s):
            best = (nodes, row)
        previous = nodes
    if best is None:
        raise UserError("--deadline", "no strategy fits in the GPU's memory on any node count",
                        "use a smaller --batch-size, --activation-checkpointing, or GPUs with more memory")
    nodes, row = best
    raise UserError(f"--deadline {format_walltime(deadline_s)}",
                    f"no node count meets it: the best is {format_walltime(row.ask_s)} on {nodes} node"
                    f"{'s' if nodes > 1 else ''} ({row.option.name})",
                    "allow more time, or train fewer epochs (--epochs) or steps (--max-steps)")


def _node_counts(max_nodes: int) -> list[int]:
    """Node counts to try: every one to 16, then steps of about 1.5x (the gaps are searched on a hit)."""
    counts, nodes = [], 1
    while nodes <= max_nodes:
        counts.append(nodes)
        nodes = nodes + 1 if nodes < 16 else nodes * 3 // 2
    return counts


def format_walltime(seconds: float) -> str:
    """Seconds as the scheduler's ``HH:MM:SS``, or ``D-HH:MM:SS`` from a day, rounded up to the minute."""
    minutes = ceil(seconds / 60)
    days, minutes = divmod(minutes, 24 * 60)
    clock = f"{minutes // 60:02d}:{minutes % 60:02d}:00"
    return f"{days}-{clock}" if days else clock
