"""A job checked against the nodes the scheduler says it has, before it is submitted.

A preset is a guess about a cluster; the scheduler knows. :func:`fit_job` takes the nodes of
the job's partition (Slurm) or queue (PBS), as :mod:`nodescale.launch.schedulers.slurm_nodes`
and ``pbs_nodes`` read them, and refuses a request no node (or not enough nodes) can meet:
node count, GPUs, CPUs, memory, time limit, each naming the limit and the value that fits.
A generic preset's CPUs and GPUs per node are sized from the nodes first: its cautious 16
cores would otherwise pend forever on smaller nodes (Slurm's reason PartitionConfig).
Pure: the reading is the schedulers' modules' job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nodescale.errors import UserError
from nodescale.launch import startup
from nodescale.launch.spec import JobSpec, Preset, walltime_seconds

# Presets that describe no cluster in particular: sized from the live nodes when they can be read.
GENERIC_PRESETS = ("generic-slurm", "generic-pbs")



@dataclass(frozen=True)
class Node:
    """One node as the scheduler configures it."""

    name: str
    cpus: int
    gpus: int  # GPUs the scheduler schedules (Slurm gres gpu, PBS ngpus); 0 where none
    memory_mb: int | None  # Slurm RealMemory, PBS resources_available.mem; None where unknown


@dataclass(frozen=True)
class Partition:
    """A partition (queue) and its nodes, with the limits the scheduler enforces."""

    name: str
    nodes: tuple[Node, ...]
    kind: str = "partition"  # what the scheduler calls it, for the messages: partition, queue, allocation
    max_time: str | None = None  # as the scheduler writes it, for the message; None: no limit
    max_time_s: int | None = None
    max_nodes: int | None = None  # the most nodes one job may have, where the partition says


@dataclass(frozen=True)
class Unreachable:
    """Why the nodes could not be read (no client, no configuration, no such partition)."""

    reason: str


def clock_seconds(text: str) -> int | None:
    """A scheduler's time limit in seconds: ``D-HH:MM:SS``, ``HH:MM:SS``, ``MM:SS`` or minutes (Slurm).

    None for no limit (UNLIMITED, INFINITE, NONE) and for text that is none of these.
    """
    text = text.strip()
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not (days == "" or days.isdigit()) or not all(part.isdigit() for part in parts) or len(parts) > 3:
        return None
    numbers = [int(part) for part in parts]
    if len(parts) == 1:
        seconds = numbers[0] * 60  # Slurm: a bare number is minutes
    else:
        seconds = sum(value * 60 ** power for power, value in enumerate(reversed(numbers)))
    return int(days or 0) * 86400 + seconds


def fit_job(spec: JobSpec, preset: Preset, partition: Partition) -> Preset:
    """``preset`` sized to ``partition`` (generic presets only); UserError for a request it cannot meet."""
    where = f"{partition.kind} {partition.name}"
    nodes = list(partition.nodes)
    _check_count(spec, where, len(nodes), partition.max_nodes)

    if spec.gpus_per_node and preset.gpu_request != "none":
        nodes = _enough(spec, nodes, lambda node: node.gpus, spec.gpus_per_node, f"{where}'s nodes", "GPUs",
                        f"--gpus-per-node {spec.gpus_per_node}", lambda fit: (
                            f"--gpus-per-node {fit}" if fit else
                            "--gpus-per-node 0 (CPU processes), or a partition with GPU nodes (--queue)"))
    if preset.name in GENERIC_PRESETS:
        # The N-th largest: the most that each of N nodes has.
        preset = preset.model_copy(update={"cpus_per_node": max(1, _nth_largest(spec, nodes, "cpus")),
                                           "gpus_per_node": _nth_largest(spec, nodes, "gpus")})

    tasks = startup.tasks_per_node(spec)
    per_task = startup.cpus_per_task(spec, preset)
    explicit = spec.options.cpus_per_task
    asked = (f"--cpus-per-task {per_task}" if explicit else
             f"--nproc-per-node {tasks} --mode per-gpu ({per_task} CPUs each)" if tasks > 1 else
             f"--cluster {preset.name} ({preset.cpus_per_node} cores per node)")
    nodes = _enough(spec, nodes, lambda node: node.cpus // tasks, per_task, f"{where}'s nodes",
                    "CPUs per task" if tasks > 1 else "CPUs", asked, lambda fit: (
                        f"fewer processes per node: --nproc-per-node {max(node.cpus for node in nodes)} or less"
                        if fit == 0 else f"--cpus-per-task {fit}"))

    mem = spec.options.mem_mb
    if mem and all(node.memory_mb is not None for node in nodes):
        _enough(spec, nodes, lambda node: node.memory_mb or 0, mem, f"{where}'s nodes", "MB of memory",
                f"--mem {spec.options.mem}", lambda fit: f"--mem {fit}M or less")

    if partition.max_time_s is not None and walltime_seconds(spec.time) > partition.max_time_s:
        raise UserError(f"--time {spec.time}", f"{where} allows at most {partition.max_time}",
                        f"ask for --time {_hms(partition.max_time_s)} or less; checkpoints let the next job resume")
    return preset


def _check_count(spec: JobSpec, where: str, have: int, max_nodes: int | None) -> None:
    if spec.nodes > have:
        raise UserError(f"--nodes {spec.nodes}", f"{where} has {have} node{'s' * (have != 1)}",
                        f"--nodes {have} or fewer, or another partition (--queue)")
    if max_nodes is not None and spec.nodes > max_nodes:
        raise UserError(f"--nodes {spec.nodes}", f"{where} allows at most {max_nodes} nodes per job",
                        f"--nodes {max_nodes} or fewer, or another partition (--queue)")


def _enough(spec: JobSpec, nodes: list[Node], amount: Callable[[Node], int], need: int, where: str, what: str,
            asked: str, hint: Callable[[int], str]) -> list[Node]:
    """The nodes with at least ``need`` of ``amount``; UserError when fewer than the job's nodes have it.

    The hint is given the value that fits: the most that each of the job's N nodes has.
    """
    fitting = [node for node in nodes if amount(node) >= need]
    if len(fitting) >= spec.nodes:
        return fitting
    amounts = sorted((amount(node) for node in nodes), reverse=True)
    fit = amounts[spec.nodes - 1]
    many = f"each of {spec.nodes} nodes" if spec.nodes > 1 else "one node"
    raise UserError(asked, f"{len(fitting)} of {where} ({len(nodes)}) have {need} {what}; "
                    f"{many} must, and {fit} is the most that fits", hint(fit))


def _nth_largest(spec: JobSpec, nodes: list[Node], field: str) -> int:
    values = sorted((getattr(node, field) for node in nodes), reverse=True)
    return values[min(spec.nodes, len(values)) - 1] if values else 0


def _hms(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock
