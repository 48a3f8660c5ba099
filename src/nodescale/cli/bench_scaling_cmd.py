"""``nodescale bench scaling``: train at several world sizes; table, JSON, CSV and plot of the scaling."""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

from nodescale.bench import peaks, scaling_math
from nodescale.cli import bench_scaling_study
from nodescale.errors import UserError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "scaling",
        help="train at world sizes 1, 2, 4, ...: samples/s, speedup, efficiency, step time, MFU",
        description="Train the same model for a fixed number of steps at each world size (one `nodescale train "
        "--nproc N` after the other, warm-up excluded from timing) and report throughput, speedup and efficiency "
        "relative to the smallest world size. Writes OUT/ws-N/ (each run), OUT/scaling.json, OUT/scaling.csv and "
        "OUT/scaling.png. Flags after -- go to every `nodescale train`.",
    )
    parser.add_argument("--out", type=Path, metavar="DIR", help="directory for the runs and results (required)")
    parser.add_argument("--world-sizes", metavar="LIST",
                        help="comma-separated process counts, e.g. 1,2,4 (default: 1, 2, 4, ... up to the GPUs "
                        "of this machine, or its CPU cores, and at least 1,2)")
    parser.add_argument("--mode", choices=scaling_math.MODES, default=None,
                        help="strong: fixed global batch, split over the processes; weak: fixed batch per process "
                        "(default: strong; with --collect, inferred from the runs)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="B",
                        help="strong: the global batch (each world size must divide it); weak: each process's "
                        "batch (default 64)")
    parser.add_argument("--max-steps", type=int, default=50, metavar="K",
                        help="optimiser steps per world size, warm-up included (default 50)")
    parser.add_argument("--warmup-steps", type=int, default=10, metavar="W",
                        help="first steps left out of the timing (default 10)")
    parser.add_argument("--model", help="model to train (default: nodescale train's, cnn)")
    parser.add_argument("--dataset", help="dataset (default: nodescale train's, digits)")
    parser.add_argument("--strategy", help="ddp, fsdp or deepspeed (default: nodescale train's, ddp)")
    parser.add_argument("--peak-dtype", choices=peaks.PEAK_DTYPE_CHOICES, default="auto",
                        help="which peak MFU is measured against (default auto: bf16/fp16 runs their own, fp32 "
                        "runs TF32 where the device has it)")
    parser.add_argument("--collect", nargs="?", const=True, default=False, metavar="DIR",
                        help="train nothing: build the results from the runs already in DIR (default --out): "
                        "DIR/ws-N, or the finished sizes of a study across node counts")
    parser.add_argument("--dry-run", action="store_true", help="print the nodescale train command of each "
                        "world size and stop")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_FLAGS",
                        help="more `nodescale train` flags for every run, e.g. -- --precision bf16")
    bench_scaling_study.add_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.collect:  # starts no processes: also at the end of a study's job, inside its allocation
        return _collect(args)
    _refuse_launcher()
    if args.out is None:
        raise UserError("bench scaling without --out", "needs a directory for the runs and results",
                        "e.g. --out scale")
    from nodescale.bench.scaling import ScalingPlan, TrainingFailed, default_world_sizes, local_capacity, run_all

    extra = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    passed = [*_pair("--model", args.model), *_pair("--dataset", args.dataset), *_pair("--strategy", args.strategy)]
    if bench_scaling_study.wanted(args):
        return bench_scaling_study.run(args, (*passed, *extra), lambda plan: _check_plan(plan, extra))
    sizes = scaling_math.parse_world_sizes(args.world_sizes) if args.world_sizes else default_world_sizes()
    mode = args.mode or "strong"
    plan = ScalingPlan(args.out, tuple(sizes), mode, args.batch_size, args.max_steps, args.warmup_steps,
                       (*passed, *extra))
    _check_plan(plan, extra)
    if args.dry_run:
        for world_size in plan.world_sizes:
            print(shlex.join(["nodescale", *plan.train_argv(world_size)]))
        return 0
    _check_out(plan)
    capacity, kind = local_capacity()
    over = [n for n in sizes if n > capacity]
    if over:
        warnings.warn(f"world size {', '.join(map(str, over))} exceeds this machine's {capacity} {kind}: the "
                      "processes will share them, so those numbers show oversubscription, not scaling", stacklevel=1)
    batch = "global batch" if mode == "strong" else "batch per process"
    print(f"nodescale bench scaling: {mode} scaling, world sizes {', '.join(map(str, sizes))}, {batch} "
          f"{args.batch_size}, {args.max_steps} steps ({args.warmup_steps} warm-up) -> {args.out}", flush=True)
    try:
        result = run_all(plan, lambda line: print(line, flush=True), args.peak_dtype)
    except TrainingFailed as exc:
        _show_failure(exc)
        return 2 if exc.code == 2 else 1
    _print_result(result, args.out)
    return 0


def _pair(flag: str, value: str | None) -> list[str]:
    return [] if value is None else [flag, value]


def _refuse_launcher() -> None:
    from nodescale.distributed.env import detect

    source = detect().source
    if source != "single":
        raise UserError(f"nodescale bench scaling started by {source}",
                        "it starts its own training processes and must run once, not once per task",
                        "run it on its own; for multi-node scaling run one job per world size and use --collect "
                        "(docs/bench-scaling.md)")


def _check_plan(plan: Any, extra: list[str]) -> None:
    """Every mistake found before the first process starts: steps, batch split, train flags."""
    from nodescale.bench.scaling import check_train_args
    from nodescale.cli.run_flags import FLAG_NAMES, add_run_flags, resolve_config
    from nodescale.data.registry import get_format

    if plan.max_steps < 1 or plan.warmup_steps < 0 or plan.warmup_steps >= plan.max_steps:
        raise UserError(f"--max-steps {plan.max_steps} with --warmup-steps {plan.warmup_steps}",
                        "need at least one timed step after the warm-up (0 <= warm-up < max steps)",
                        "e.g. --max-steps 50 --warmup-steps 10")
    if plan.batch_size < 1:
        raise UserError(f"--batch-size {plan.batch_size}", "must be at least 1", "e.g. --batch-size 64")
    if plan.mode == "strong":
        scaling_math.check_batch_divides(plan.batch_size, plan.world_sizes)
    check_train_args(extra, FLAG_NAMES)
    # The same parser and validation as `nodescale train`, so a typo fails in a second, not after a run.
    train_parser = argparse.ArgumentParser(prog="nodescale train (after --)", add_help=False)
    add_run_flags(train_parser)
    for world_size in plan.world_sizes:
        cfg = resolve_config(train_parser.parse_args(plan.train_argv(world_size)[1:]))
        if world_size > 1 and not cfg.strategy.multi_process:
            raise UserError(f"--strategy {cfg.strategy.name}", "runs in one process and cannot scale",
                            "use --strategy ddp, fsdp or deepspeed")
    get_format(cfg.data.name).check(cfg.data)


def _check_out(plan: Any) -> None:
    from nodescale.engine.run_dir import run_files_in

    used = [plan.run_dir(n) for n in plan.world_sizes if run_files_in(plan.run_dir(n))]
    if used:
        raise UserError(f"--out {str(plan.out)!r}", f"already holds runs ({', '.join(p.name for p in used)})",
                        "choose another --out, or add --collect to analyse the runs there again")


def _collect(args: argparse.Namespace) -> int:
    from nodescale.bench.scaling_results import collect, write_outputs
    from nodescale.bench.scaling_study import collect_study, is_study

    out = Path(args.collect) if isinstance(args.collect, str) else args.out
    if out is None or not out.is_dir():
        raise UserError(f"--collect {out or '(no directory)'}", "is not a directory",
                        "pass the directory holding the runs: --collect DIR (a study) or --collect --out DIR")
    if is_study(out):
        result = collect_study(out, args.peak_dtype, args.mode)
        for job in result["study"]["jobs"]:
            print(f"  {job['nodes']} node(s), job {job['job_id']}: {job['state']}")
        if not result["rows"]:
            print(f"no size has finished yet in {out}")
            return 0
        _print_result(result, out)
        return 0
    sizes = scaling_math.parse_world_sizes(args.world_sizes) if args.world_sizes else None
    result = collect(out, args.mode, args.peak_dtype, None, sizes)
    write_outputs(out, result)
    _print_result(result, out)
    return 0


def _show_failure(exc: Any) -> None:
    lines = exc.log.read_text(encoding="utf-8", errors="replace").splitlines()
    print("\n".join(lines[-15:]), file=sys.stderr)
    print(f"nodescale: error: {exc}", file=sys.stderr)


def _print_result(result: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from nodescale.bench.scaling_results import display_table

    settings = result["settings"]
    table = Table(title=f"{result['mode']} scaling: {settings['model']} on {settings['dataset']}, "
                  f"{settings['strategy']}, {settings['precision']}, {result['device']}", title_justify="left")
    headers, rows = display_table(result)
    for header in headers:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*row)
    # A log file gets wide lines rather than a table squeezed into 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(table)
    if any(row.get("oversubscribed") for row in result["rows"]):
        console.print("* more processes than this machine's GPUs or cores", highlight=False)
    for note in result["notes"]:
        console.print(f"note: {note}", highlight=False)
    peak = result.get("peak")
    if peak:
        console.print(f"MFU against {peak['tflops']} TFLOP/s {peak['dtype']} per device ({peak['source']})",
                      highlight=False)
    console.print(f"wrote {out / 'scaling.json'}, {out / 'scaling.csv'} and {out / 'scaling.png'}", highlight=False)
