"""Seconds per optimiser step: compute from FLOPs at a stated efficiency, communication from bytes moved.

Compute is the model's training FLOPs (3x the forward; 4x with activation checkpointing, which
runs each block's forward twice) over the GPU's peak times ``efficiency``. Communication is, per
collective, the bytes each strategy moves per step times nccl-tests' bus factor over the bus
bandwidth (``bench.comm_math``); it is added to compute, not overlapped, so the estimate errs
long. CPU offload adds host-device copies over PCIe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nodescale.bench.comm_math import bus_factor
from nodescale.plan.hardware import GB, Hardware
from nodescale.plan.model_facts import ModelFacts
from nodescale.plan.options import StrategyOption
from nodescale.plan.state_bytes import StateBytes

PCIE_GBPS = 25.0  # host <-> GPU copies of offloaded state: PCIe 4.0 x16 carries 32 GB/s per direction at most


@dataclass(frozen=True)
class Layout:
    """How the ranks are spread: ``nodes`` x ``ranks_per_node``."""

    nodes: int
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float | None  # None: no bandwidth known
    offload_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + (self.comm_s or 0.0) + self.offload_s

    def as_dict(self) -> dict[str, float | None]:
        return {**asdict(self), "total_s": self.total_s}


def collectives(option: StrategyOption, facts: ModelFacts, layout: Layout, precision: str,
                grad_accum: int = 1) -> list[tuple[str, float, int]]:
    """(collective, bytes per step, ranks taking part) for one optimiser step under ``option``.

    Bytes are the whole collective's size, as nccl-tests counts it. Parameters travel in the compute
    precision (FSDP's bf16 policy, DeepSpeed's half-precision weights); gradients are reduced in fp32,
    DeepSpeed's in the run's precision. FSDP and ZeRO-3 gather the parameters for every micro-batch.
    """
    n = layout.world_size
    if n == 1:
        return []
    half = precision in ("bf16", "fp16")
    params = facts.parameter_count * (2 if half else 4)
    grads = facts.parameter_count * (2 if half and option.family == "zero" else 4)
    if option.family == "ddp":
        return [("all_reduce", grads, n)]
    if option.family == "zero" and option.stage < 3:
        return [("reduce_scatter", grads, n), ("all_gather", params, n)]
    gathers = (1 if option.sharding == "grad-op" else 2) * grad_accum
    if option.sharding == "hybrid" and layout.nodes > 1:
        local = layout.ranks_per_node
        return [("all_gather", gathers * params, local), ("reduce_scatter", grads, local),
                ("all_reduce", grads / local, layout.nodes)]
    return [("all_gather", gathers * params, n), ("reduce_scatter", grads, n)]


def step_time(option: StrategyOption, facts: ModelFacts, hardware: Hardware, layout: Layout, precision: str,
              efficiency: float, grad_accum: int = 1, held: StateBytes | None = None) -> StepTime:
    """Seconds of one optimiser step (``grad_accum`` micro-batches of ``facts.batch_size``) on every rank.

    ``held``: the state the rank keeps before offload, whose parameters and gradients an offloading
    option copies between host and GPU once per step.
    """
    passes = 4 if option.checkpointing else 3
    flops = passes * facts.forward_flops_per_sample * facts.batch_size * grad_accum
    compute = flops / (hardware.peak_flops * efficiency)
    comm: float | None = 0.0
    for op, size, ranks in collectives(option, facts, layout, precision, grad_accum):
        bandwidth = hardware.bandwidth(op)
        if bandwidth is None:
            comm = None
            break
        comm += size * bus_factor(op, ranks) / (bandwidth * GB)
    offload = 0.0
    if option.offload != "none" and held is not None:
        offload = (held.parameter_bytes + held.gradient_bytes) / (PCIE_GBPS * GB)
    return StepTime(compute, comm, offload)
