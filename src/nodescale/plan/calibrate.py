"""The plan against a real run: the run's own option, the plan's figures for it, and an efficiency fitted to it.

``nodescale plan --calibrate RUN`` replaces the default efficiency by the one that makes the plan's
step time equal the run's measured ``step_seconds``: its compute time is what is left of the measured
step once the plan's communication and offload copies are taken off. ``nodescale report`` puts the
plan's figures for a run beside the measured ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from math import ceil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodescale.errors import UserError
from nodescale.plan.hardware import Hardware
from nodescale.plan.model_facts import ModelFacts
from nodescale.plan.options import StrategyOption
from nodescale.plan.state_bytes import PERSISTENCE_THRESHOLD, Optimiser, StateBytes, state_bytes
from nodescale.plan.step_time import Layout, StepTime, step_time

if TYPE_CHECKING:
    from nodescale.config.schema import RunConfig


@dataclass(frozen=True)
class MeasuredRun:
    """A finished run as the plan reads it: its summary.json and the config it was run with."""

    path: Path  # the run directory
    summary: dict[str, Any]
    cfg: RunConfig

    @property
    def world_size(self) -> int:
        return int(self.summary.get("world_size") or 1)


@dataclass(frozen=True)
class Calibration:
    """An efficiency fitted to one run's step time, and what it was fitted to."""

    run: str
    world_size: int
    measured_step_s: float
    comm_s: float
    efficiency: float


def read_run(given: Path) -> MeasuredRun:
    """The run of ``given``: a run directory or its summary.json (its config.yaml must be beside it)."""
    from nodescale.config.load import load_config

    run_dir = given.parent if given.name == "summary.json" else given
    what = f"--calibrate {str(given)!r}"
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(what, f"has no readable summary.json ({type(exc).__name__})",
                        "give the directory (or summary.json) of a finished `nodescale train` run") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("step_seconds"), (int, float)):
        raise UserError(what, "summary.json has no step_seconds",
                        "give the directory (or summary.json) of a finished `nodescale train` run") from None
    if not (run_dir / "config.yaml").is_file():
        raise UserError(what, "has no config.yaml beside summary.json",
                        "give the directory of a `nodescale train` run, which writes both")
    return MeasuredRun(run_dir, summary, load_config(run_dir / "config.yaml"))


def run_option(cfg: RunConfig) -> StrategyOption:
    """The plan's option for the strategy ``cfg`` ran with."""
    strategy = cfg.strategy
    offload = getattr(strategy, "cpu_offload", "none")
    checkpointing = cfg.train.activation_checkpointing
    if strategy.name == "deepspeed":
        stage = str(strategy.zero_stage if strategy.zero_stage is not None else 2)
        return StrategyOption("zero", stage, checkpointing, offload)
    if strategy.name == "fsdp":
        return StrategyOption("fsdp", strategy.sharding, checkpointing, offload)
    return StrategyOption("ddp", checkpointing=checkpointing)


def run_layout(world_size: int, ranks_per_node: int | None) -> Layout:
    """The run's nodes x ranks: full nodes of ``ranks_per_node`` (None: one node)."""
    per_node = min(ranks_per_node or world_size, world_size)
    return Layout(ceil(world_size / per_node), per_node)


def run_state(cfg: RunConfig, facts: ModelFacts, layout: Layout, option: StrategyOption | None = None,
              threshold: int | None = None) -> StateBytes:
    """The state bytes per rank the plan gives ``cfg``'s run (``option``: its own strategy's)."""
    return state_bytes(option or run_option(cfg), facts.shapes, layout.world_size, layout.ranks_per_node,
                       Optimiser.named(cfg.optim.name, cfg.optim.momentum), cfg.train.precision,
                       persistence_threshold(cfg) if threshold is None else threshold)


def run_step_time(run: MeasuredRun, facts: ModelFacts, hardware: Hardware, layout: Layout,
                  efficiency: float) -> StepTime:
    """The plan's step time for ``run``'s own option on ``layout``."""
    option = run_option(run.cfg)
    held = run_state(run.cfg, facts, layout, replace(option, offload="none"))
    return step_time(option, facts, hardware, layout, run.cfg.train.precision, efficiency,
                     run.cfg.train.grad_accum, held)


def persistence_threshold(cfg: RunConfig) -> int:
    """ZeRO-3's persistence threshold: the run's DeepSpeed config file's, else DeepSpeed's default."""
    path = getattr(cfg.strategy, "deepspeed_config", None)
    if path is None:
        return PERSISTENCE_THRESHOLD
    from nodescale.strategies.deepspeed_config import read_user_config

    zero = read_user_config(path).get("zero_optimization") or {}
    return int(zero.get("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD))


def calibrate(run: MeasuredRun, facts: ModelFacts, hardware: Hardware, ranks_per_node: int | None) -> Calibration:
    """The efficiency at which the plan's step time for ``run`` (``facts``: its model) equals the measured one."""
    measured = float(run.summary["step_seconds"])
    at_peak = run_step_time(run, facts, hardware, run_layout(run.world_size, ranks_per_node), 1.0)
    overhead = (at_peak.comm_s or 0.0) + at_peak.offload_s
    what = f"--calibrate {str(run.path)!r}"
    if measured <= overhead:
        raise UserError(what, f"its measured step ({measured * 1e3:.1f} ms) is not longer than the communication "
                        f"and copies the plan prices for it ({overhead * 1e3:.1f} ms), so no compute time is left "
                        "to fit", "calibrate on a run with fewer ranks (one is best), or give --comm with the "
                        "bandwidth measured where the run ran")
    efficiency = at_peak.compute_s / (measured - overhead)
    if efficiency > 1:
        raise UserError(what, f"it computed faster than the peak allows ({efficiency:.0%} of "
                        f"{hardware.peak_flops / 1e12:g} TFLOP/s)",
                        "check --peak-tflops (or the GPU the preset names) against the GPU the run used")
    return Calibration(str(run.path), run.world_size, measured, overhead, efficiency)


def check_same_model(run: MeasuredRun, cfg: RunConfig) -> None:
    """A calibration carries over to the same model only."""
    if run.cfg.model.name != cfg.model.name:
        raise UserError(f"--calibrate {str(run.path)!r}", f"is a run of {run.cfg.model.name!r}, not of "
                        f"{cfg.model.name!r}: an efficiency is a property of one model on one GPU",
                        f"calibrate on a run of --model {cfg.model.name}, or give --efficiency")


@dataclass(frozen=True)
class RunEstimate:
    """The plan's figures for a finished run, on its own device, world size and strategy (one node assumed)."""

    state: StateBytes
    activation_bytes: int
    gathered_bytes: int
    step: StepTime | None  # None: the run's device is not in bench/peaks.yaml
    global_batch: int
    efficiency: float

    @property
    def samples_per_s(self) -> float | None:
        return self.global_batch / self.step.total_s if self.step else None


def estimate_run(run: MeasuredRun, efficiency: float) -> RunEstimate:
    """What the plan says of ``run``: its model measured without memory on its dataset's samples; the step at
    ``efficiency`` of its device's peak, communication not priced (no bandwidth is known for a past run)."""
    from nodescale.bench.peaks import find_peak, peak_dtype
    from nodescale.plan.estimate import gathered_bytes
    from nodescale.plan.inputs import dataset_facts
    from nodescale.plan.model_facts import measure_model

    cfg = run.cfg
    facts = measure_model(cfg, dataset_facts(cfg)[0])
    layout = run_layout(run.world_size, None)
    option = run_option(cfg)
    precision = cfg.train.precision
    entry = find_peak(str(run.summary.get("device") or ""))
    dtype = peak_dtype(precision, entry)  # the peak the run's MFU in summary.json is against
    peak = entry.flops(dtype) if entry else None
    step = None
    if entry and peak:
        hardware = Hardware(entry.names[0], 0, peak, dtype, {}, {})
        step = run_step_time(run, facts, hardware, layout, efficiency)
    return RunEstimate(run_state(cfg, facts, layout), facts.checkpointed_activation_bytes if option.checkpointing
                       else facts.activation_bytes, gathered_bytes(option, facts, precision), step,
                       facts.batch_size * cfg.train.grad_accum * layout.world_size, efficiency)
