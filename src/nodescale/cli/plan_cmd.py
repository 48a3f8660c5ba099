"""``nodescale plan``: which strategy fits, on how many nodes, how long it takes, what to ask for.

It takes ``train``'s flags (the same parser) and the cluster's; ``launch --plan`` calls
:func:`plan_launch` with the job it is about to submit.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nodescale.cli.run_flags import add_run_flags, resolve_config
from nodescale.errors import UserError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="estimate memory, step time and wall time of every strategy before queueing",
        description="Measure the model without memory, then price every strategy option (DDP, FSDP full / "
        "grad-op / hybrid, ZeRO-1/2/3, each with and without activation checkpointing and CPU offload): bytes per "
        "rank against the GPU's memory, step time, throughput, time for the epochs and the --time to ask for.",
    )
    add_run_flags(parser)
    add_plan_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(handler=run)


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the cluster and of the estimate (``launch --plan`` has the cluster's already)."""
    parser.add_argument("--cluster", metavar="PRESET", help="cluster preset: GPUs per node, GPU memory, bandwidth")
    parser.add_argument("--nodes", help="nodes (default: 1, or the fewest that meet --deadline)")
    parser.add_argument("--gpus-per-node", help="GPUs (ranks) per node (default: the preset's)")
    parser.add_argument("--train-samples", metavar="N", help="training samples per epoch (default: the dataset's)")
    parser.add_argument("--sample-shape", metavar="SHAPE",
                        help="one input sample's shape, e.g. 3,224,224 or 1024 (tokens): skips loading the dataset")
    parser.add_argument("--num-classes", metavar="N", help="with --sample-shape: classes (or vocabulary size)")
    parser.add_argument("--deadline", metavar="TIME", help="HH:MM:SS or D-HH:MM:SS: the fewest nodes that meet it")
    parser.add_argument("--comm", metavar="RESULTS_JSON", help="bus bandwidth from `nodescale bench comm` results.json")
    parser.add_argument("--gpu-memory", metavar="GB", help="memory of one GPU in GB (default: the preset's)")
    parser.add_argument("--peak-tflops", metavar="TFLOPS",
                        help="peak dense TFLOP/s of one GPU in the run's precision (default: bench/peaks.yaml)")
    parser.add_argument("--efficiency", metavar="FRACTION",
                        help="fraction of peak FLOP/s training reaches (default: 0.4)")
    parser.add_argument("--calibrate", metavar="RUN",
                        help="fit the efficiency to a finished run of the same model on the same GPU: its directory "
                        "or summary.json (its measured step time, less the communication the plan prices)")


def settings_from(args: argparse.Namespace, all_strategies: bool) -> object:
    """The plan settings of the parsed flags, each number checked."""
    from nodescale.launch.spec import walltime_seconds
    from nodescale.plan.inputs import parse_sample_shape
    from nodescale.plan.make import DEFAULT_EFFICIENCY, PlanSettings

    deadline = None
    if args.deadline is not None:
        try:
            deadline = float(walltime_seconds(str(args.deadline)))
        except ValueError as exc:
            raise UserError(f"--deadline {args.deadline}", str(exc), "e.g. --deadline 12:00:00 or 2-00:00:00") from None
    if args.calibrate is not None and args.efficiency is not None:
        raise UserError(f"--efficiency {args.efficiency} with --calibrate",
                        "the calibration fits the efficiency", "give one of them")
    efficiency = _number("--efficiency", args.efficiency, float, DEFAULT_EFFICIENCY)
    if not 0 < efficiency <= 1:
        raise UserError(f"--efficiency {args.efficiency}", "must be above 0 and at most 1", "e.g. --efficiency 0.4")
    return PlanSettings(
        cluster=args.cluster, nodes=_number("--nodes", args.nodes, int), all_strategies=all_strategies,
        gpus_per_node=_number("--gpus-per-node", args.gpus_per_node, int),
        train_samples=_number("--train-samples", args.train_samples, int),
        sample_shape=parse_sample_shape(args.sample_shape) if args.sample_shape is not None else None,
        num_classes=_number("--num-classes", args.num_classes, int), deadline_s=deadline,
        comm=Path(args.comm) if args.comm is not None else None,
        gpu_memory_gb=_number("--gpu-memory", args.gpu_memory, float),
        peak_tflops=_number("--peak-tflops", args.peak_tflops, float), efficiency=efficiency,
        calibrate=Path(args.calibrate) if args.calibrate is not None else None,
    )


def _number(flag: str, text: str | None, kind: type, default: float | None = None):  # noqa: ANN202
    if text is None:
        return default
    try:
        value = kind(str(text).strip())
    except ValueError:
        value = None
    if value is None or value != value or value <= 0 or value == float("inf"):
        noun = "a whole number" if kind is int else "a number"
        raise UserError(f"{flag} {text}", f"must be {noun} above 0", f"e.g. {flag} {'4' if kind is int else '0.4'}")
    return value


def run(args: argparse.Namespace) -> int:
    all_strategies = args.strategy__name in (None, "auto")
    if all_strategies:
        args.strategy__name = None
    settings = settings_from(args, all_strategies)
    from nodescale.plan.make import make_plan

    plan = make_plan(resolve_config(args), settings)  # type: ignore[arg-type]
    show(plan, as_json=args.json)
    return 0


def show(plan: object, as_json: bool = False) -> None:
    """Print ``plan``: the table and its basis, or JSON."""
    from nodescale.plan.render import plan_json, plan_table, summary_lines

    if as_json:
        print(json.dumps(plan_json(plan), indent=2))  # type: ignore[arg-type]
        return
    from rich.console import Console

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    console.print(plan_table(plan))  # type: ignore[arg-type]
    for line in summary_lines(plan):  # type: ignore[arg-type]
        console.print(line)


def plan_launch(spec: Any, preset: Any) -> None:
    """``launch --plan``: print the plan of the job's ``nodescale train`` on its nodes, ranks and preset, and warn
    when its ``--time`` is shorter than the ``--time`` the plan asks for its strategy."""
    import warnings

    from nodescale.launch.spec import walltime_seconds
    from nodescale.plan.calibrate import run_option
    from nodescale.plan.estimate import format_walltime
    from nodescale.plan.make import PlanSettings, make_plan

    command = list(spec.command)
    train = train_argv(command)
    if train is None:
        raise UserError(f"--plan with {' '.join(command[:3])!r}", "plans a `nodescale train` command only: the "
                        "cost of another program is not known", "put `nodescale train ...` after --, or drop --plan "
                        "(for your own script, `nodescale plan --model FILE.py:FUNCTION` prices its model)")
    cfg = resolve_config(_train_parser().parse_args(train))
    settings = PlanSettings(cluster=preset.name if preset is not None else None, nodes=spec.nodes,
                            gpus_per_node=spec.nproc_per_node, all_strategies=False)
    try:
        plan = make_plan(cfg, settings)
    except UserError as exc:
        if "--gpu-memory" not in (exc.hint or ""):
            raise
        raise UserError(exc.what, exc.rule, "run `nodescale plan` with the same train flags and --gpu-memory, "
                        "--peak-tflops; or give the preset gpu_model and gpu_memory_gb") from None
    show(plan)
    own = next((row for row in plan.rows if row.option == run_option(cfg)), None)  # type: ignore[attr-defined]
    if own is not None and walltime_seconds(spec.time) < own.ask_s:
        warnings.warn(f"--time {spec.time} is shorter than the {format_walltime(own.ask_s)} the plan asks for "
                      f"{own.option.name} (training {format_walltime(own.train_s)} plus start-up, checkpoints and "
                      "10%): the job may end before training does", stacklevel=2)


def train_argv(command: Sequence[str]) -> list[str] | None:
    """The flags of a ``nodescale train`` (or ``python -m nodescale train``) command; None for any other."""
    words = list(command)
    if words[:1] and Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "nodescale"]:
        words = ["nodescale", *words[3:]]
    if words[:2] == ["nodescale", "train"]:
        return words[2:]
    return None


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodescale train", add_help=False)
    add_run_flags(parser)
    return parser
