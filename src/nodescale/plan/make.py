"""One call from a resolved ``train`` configuration and the cluster to a plan (what ``launch --plan`` calls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodescale.errors import UserError
from nodescale.plan.calibrate import (
    Calibration,
    calibrate,
    check_same_model,
    persistence_threshold,
    read_run,
    run_layout,
    run_state,
)
from nodescale.plan.estimate import PlanRow, Workload, nodes_for_deadline, plan_rows, recommend
from nodescale.plan.hardware import Hardware, resolve_hardware
from nodescale.plan.inputs import dataset_facts, sample_spec
from nodescale.plan.model_facts import ModelFacts, measure_model
from nodescale.plan.options import StrategyOption, options_for_strategy
from nodescale.plan.state_bytes import Optimiser, StateBytes
from nodescale.plan.step_time import Layout

if TYPE_CHECKING:
    from nodescale.config.schema import RunConfig
    from nodescale.models.spec import InputSpec

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
    calibrate: Path | None = None  # a run whose measured step time fixes the efficiency


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
    calibration: Calibration | None = None


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
    calibration = _calibrated(settings.calibrate, cfg, spec, hardware, per_node)
    efficiency = calibration.efficiency if calibration else settings.efficiency
    work = Workload(samples, cfg.train.epochs, cfg.train.max_steps, cfg.train.grad_accum, cfg.train.precision,
                    Optimiser.named(cfg.optim.name, cfg.optim.momentum), efficiency, cfg.checkpoint.every,
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
    return Plan(facts, hardware, work, layout, rows, best, notes, cfg.model.name, calibration)


def _calibrated(given: Path | None, cfg: RunConfig, spec: InputSpec, hardware: Hardware,
                per_node: int) -> Calibration | None:
    """The efficiency fitted to the run ``given`` (None: none given), its model measured at the run's batch."""
    if given is None:
        return None
    run = read_run(given)
    check_same_model(run, cfg)
    return calibrate(run, measure_model(run.cfg, spec), hardware, per_node)


def planned_state(cfg: RunConfig, world_size: int, ranks_per_node: int | None = None) -> StateBytes:
    """The state bytes per rank the plan gives ``cfg``'s own strategy (what its run reports in summary.json)."""
    spec, _ = dataset_facts(cfg)
    return run_state(cfg, measure_model(cfg, spec), run_layout(world_size, ranks_per_node))


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
    options = options_for_strategy(section)
    if not options:  # FSDP's sharding none replicates everything: what DDP holds and moves
        raise UserError(f"--sharding {getattr(cfg.strategy, 'sharding', '')}", "is not priced by the plan",
                        "use --strategy ddp for a replicated model, or --sharding full, grad-op or hybrid")
    return options
