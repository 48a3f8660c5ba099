"""One call from a resolved ``train`` configuration and the cluster to a plan (what ``launch --plan`` calls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodescale.errors import UserError
from nodescale.plan.estimate import PlanRow, Workload, nodes_for_deadline, plan_rows, recommend
from nodescale.plan.hardware import Hardware, resolve_hardware
from nodescale.plan.inputs import dataset_facts, sample_spec
from nodescale.plan.model_facts import ModelFacts, measure_model
from nodescale.plan.options import StrategyOption, options_for_strategy
from nodescale.plan.state_bytes import PERSISTENCE_THRESHOLD, Optimiser, StateBytes, state_bytes
from nodescale.plan.step_time import Layout

if TYPE_CHECKING:
    from nodescale.config.schema import RunConfig

DEFAULT_EFFICIENCY = 0.40  # of peak FLOP/s that training reaches: a well-tuned run reaches 40-60%


@dataclass(frozen=True)
class PlanSettings:
    """What the plan needs besides the training configuration (the flags of ``plan`` and ``launch``)."""

    cluster: str | None = None
    nodes: int | None = None  # None: 1, or the fewest that meet the deadline
    gpus_per_node: int | None = None  # None: the preset's
    all_strategies: bool = True  # --strategy auto (or none given): every option
    train_samples: int | None = None
    sample_shape: tuple[int, ...] | None = None
    num_classes: int | None = None
    deadline_s: float | None = None
    comm: Path | None = None
    gpu_memory_gb: float | None = None
    peak_tflops: float | None = None
    efficiency: float = DEFAULT_EFFICIENCY


@dataclass(frozen=True)
class Plan:
    facts: ModelFacts
    hardware: Hardware
    workload: Workload
    layout: Layout
    rows: list[PlanRow]
    recommended: PlanRow | None
    notes: list[str] = field(default_factory=list)
    model: str = ""


def make_plan(cfg: RunConfig, settings: PlanSettings) -> Plan:
    """The plan of training ``cfg`` on the cluster of ``settings``: every option's row and the pick."""
    preset = _preset(settings.cluster)
    per_node = settings.gpus_per_node or (preset.gpus_per_node if preset else None)
    if not per_node:
        raise UserError("--gpus-per-node", "is needed without a --cluster preset that says it (or it says 0)",
                        "give --gpus-per-node N, or --cluster PRESET (see `nodescale clusters`)")
    hardware = resolve_hardware(preset, cfg.train.precision, cfg.train.tf32, settings.gpu_memory_gb,
                                settings.peak_tflops, settings.comm)
    spec = sample_spec(cfg, settings.sample_shape, settings.num_classes)
    samples = settings.train_samples
    if spec is None or samples is None:
        found_spec, found_samples = dataset_facts(cfg)
        spec, samples = spec or found_spec, samples or found_samples
    facts = measure_model(cfg, spec)
    work = Workload(samples, cfg.train.epochs, cfg.train.max_steps, cfg.train.grad_accum, cfg.train.precision,
                    Optimiser.named(cfg.optim.name, cfg.optim.momentum), settings.efficiency, cfg.checkpoint.every,
                    persistence_threshold(cfg))
    options = _options(cfg, settings)
    notes = []
    if settings.deadline_s is not None and settings.nodes is None:
        nodes, _ = nodes_for_deadline(settings.deadline_s, facts, hardware, work, per_node, options)
        notes.append(f"{nodes} node{'s' if nodes > 1 else ''}: the fewest that meet the deadline")
    else:
        nodes = settings.nodes or 1
    layout = Layout(nodes, per_node)
    rows = plan_rows(facts, hardware, work, layout, options)
    best = recommend(rows)
    if settings.deadline_s is not None and best is not None and best.ask_s > settings.deadline_s:
        notes.append(f"on {nodes} node(s) the deadline is not met; leave --nodes out to find the node count that does")
    return Plan(facts, hardware, work, layout, rows, best, notes, cfg.model.name)


def planned_state(cfg: RunConfig, world_size: int, ranks_per_node: int | None = None) -> StateBytes:
    """The state bytes per rank the plan gives ``cfg``'s own strategy (what its run reports in summary.json)."""
    spec, _ = dataset_facts(cfg)
    facts = measure_model(cfg, spec)
    strategy = cfg.strategy
    if strategy.name == "deepspeed":
        option = StrategyOption("zero", str(strategy.zero_stage if strategy.zero_stage is not None else 2))
    elif strategy.name == "fsdp":
        option = StrategyOption("fsdp", strategy.sharding)
    else:
        option = StrategyOption("ddp")
    return state_bytes(option, facts.shapes, world_size, ranks_per_node or world_size,
                       Optimiser.named(cfg.optim.name, cfg.optim.momentum), cfg.train.precision,
                       persistence_threshold(cfg))


def persistence_threshold(cfg: RunConfig) -> int:
    """ZeRO-3's persistence threshold: the run's DeepSpeed config file's, else DeepSpeed's default."""
    path = getattr(cfg.strategy, "deepspeed_config", None)
    if path is None:
        return PERSISTENCE_THRESHOLD
    from nodescale.strategies.deepspeed_config import read_user_config

    zero = read_user_config(path).get("zero_optimization") or {}
    return int(zero.get("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD))


def _preset(name: str | None) -> Any:
    if name is None:
        return None
    from nodescale.launch.presets import load_preset

    return load_preset(name)


def _options(cfg: RunConfig, settings: PlanSettings) -> list[StrategyOption]:
    section = None if settings.all_strategies else cfg.strategy
    if section is not None and cfg.strategy.name in ("single", "dp"):
        raise UserError(f"--strategy {cfg.strategy.name}", "plans are for one process per GPU across nodes",
                        "use --strategy ddp, fsdp, deepspeed, or auto (every option)")
    return options_for_strategy(section)
