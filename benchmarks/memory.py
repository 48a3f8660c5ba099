"""Training-state memory per rank under DDP, FSDP2 and DeepSpeed ZeRO, measured by ``nodescale train``.

For each model, runs ``nodescale train --nproc N`` once per strategy (DDP, FSDP
``--sharding full``, ``grad-op`` and ``none``, DeepSpeed ZeRO stages 1, 2 and 3,
and ZeRO-3 again with ``stage3_param_persistence_threshold: 0``) and reads
``state_bytes_per_rank`` from each run's ``summary.json``: the bytes of
parameters, gradients and optimiser state (DeepSpeed's fp32 master copy
included) that the largest rank held, measured by nodescale just before the
second optimiser step. Each total is compared with DDP's, measured in the same
invocation.

What this measures is the *resting* training state, the part that sharding
divides. It does not include activations, the parameters FSDP and ZeRO-3
gather for the duration of a forward or backward, communication buffers, or
the process's other memory. So FSDP ``grad-op`` measures like ``full`` and
ZeRO-2 like ZeRO-1: what sets them apart is held during forward and backward
only. ``peak_memory_bytes`` from the same summary (host RSS on the CPU, the
allocator's peak on a GPU) is kept in the JSON for reference; on the CPU it is
dominated by torch and DeepSpeed themselves. Known gap: ``zero-0`` under bf16
does not count DeepSpeed's whole fp32 copy of the parameters (RESULTS.md).

    python benchmarks/memory.py                                 # resnet18 and vit_small, 2 processes
    python benchmarks/memory.py --models vit_tiny --nproc 4
    python benchmarks/memory.py --strategies ddp,fsdp-full,zero-3,zero-3-t0
    python benchmarks/memory.py --models vit_tiny --precision bf16 --out /tmp/memory-bf16.json

Every model trains on ``--dataset synthetic --set data.image_size=32`` (random
3x32x32 images) with AdamW, ``--precision fp32`` unless told otherwise,
``--batch-size 8`` per process, 6 steps, the step time taken over the last 3. ``zero-0`` (DeepSpeed, no
partitioning) runs only when named. The default invocation (16 runs) takes
6-10 minutes on 2 cores. MB = 10^6 bytes. Results go to
``benchmarks/results/memory.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import HERE, child_env, machine, nodescale_summary, run_logged, wide_console, write_results  # noqa: E402

DEFAULT_OUT = HERE / "results" / "memory.json"
DEFAULT_MODELS = ("resnet18", "vit_small")
BASELINE = "ddp"
MB = 1e6  # bytes; the table's unit
WARMUP_STEPS = 3  # steps before the step time is taken (allocations, DeepSpeed's and FSDP's first-step work)

# ZeRO-3 keeps parameters with fewer than this many values whole on every rank
# (DeepSpeed's default stage3_param_persistence_threshold = 1e5); 0 shards them all.
THRESHOLD_ZERO = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


@dataclass(frozen=True)
class Strategy:
    """One way of training, as nodescale flags (and an optional DeepSpeed JSON config)."""

    name: str
    flags: tuple[str, ...]
    description: str
    deepspeed_config: dict[str, Any] | None = None


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("ddp", ("--strategy", "ddp"), "DistributedDataParallel: everything replicated"),
    Strategy("fsdp-full", ("--strategy", "fsdp", "--sharding", "full"), "FSDP2, reshard after forward"),
    Strategy("fsdp-grad-op", ("--strategy", "fsdp", "--sharding", "grad-op"),
             "FSDP2, parameters kept gathered from forward to backward"),
    Strategy("fsdp-none", ("--strategy", "fsdp", "--sharding", "none"), "FSDP2 replicating (shard dimension 1)"),
    Strategy("zero-0", ("--strategy", "deepspeed", "--zero-stage", "0"),
             "DeepSpeed without ZeRO partitioning (not run by default)"),
    Strategy("zero-1", ("--strategy", "deepspeed", "--zero-stage", "1"), "DeepSpeed ZeRO-1: optimiser state"),
    Strategy("zero-2", ("--strategy", "deepspeed", "--zero-stage", "2"),
             "DeepSpeed ZeRO-2: optimiser state and gradients"),
    Strategy("zero-3", ("--strategy", "deepspeed", "--zero-stage", "3"),
             "DeepSpeed ZeRO-3: also parameters; those under 100k values stay whole (DeepSpeed's default)"),
    Strategy("zero-3-t0", ("--strategy", "deepspeed", "--zero-stage", "3"),
             "DeepSpeed ZeRO-3 with stage3_param_persistence_threshold 0: every parameter sharded",
             deepspeed_config=THRESHOLD_ZERO),
)}


DEFAULT_STRATEGIES = tuple(name for name in STRATEGIES if name != "zero-0")


@dataclass
class RunResult:
    model: str
    strategy: str
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    total_bytes: int
    total_bytes_by_rank: list[int]
    peak_memory_bytes: int
    peak_memory_kind: str
    step_seconds: float  # steady-state time per optimiser step after the warm-up steps (slowest rank)
    wall_seconds: float  # the whole subprocess: start-up, the steps, evaluation, shutdown


# ---------------------------------------------------------------- running
def train_command(model: str, strategy: Strategy, args: argparse.Namespace, run_dir: Path,
                  ds_config: Path | None) -> list[str]:
    cmd = [
        sys.executable, "-m", "nodescale", "train", "--nproc", str(args.nproc),
        "--model", model, "--dataset", "synthetic", "--set", "data.image_size=32",
        # Only a few steps' worth of data is used; a small set keeps the final evaluation short.
        "--set", "data.samples=256",
        "--optimizer", "adamw", "--precision", args.precision,
        "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
        # The state is measured before the 2nd step; the step time after these warm-up steps.
        "--set", f"train.timing_warmup_steps={WARMUP_STEPS}",
        "--no-progress", "--out", str(run_dir),
        "--set", "checkpoint.at_end=false",  # a checkpoint adds wall time and nothing to the figures
        *strategy.flags,
    ]
    if ds_config is not None:
        cmd += ["--deepspeed-config", str(ds_config)]
    return cmd


def run_one(model: str, strategy: Strategy, args: argparse.Namespace, workdir: Path) -> RunResult:
    label = f"{model}-{strategy.name}"
    run_dir = workdir / label
    ds_config = None
    if strategy.deepspeed_config is not None:
        ds_config = workdir / f"{strategy.name}.ds_config.json"
        ds_config.write_text(json.dumps(strategy.deepspeed_config, indent=2) + "\n")
    cmd = train_command(model, strategy, args, run_dir, ds_config)
    done = run_logged(cmd, child_env(args.threads), workdir / f"{label}.log").check()
    summary = nodescale_summary(run_dir)
    state = summary.get("state_bytes_per_rank")
    if not state:
        raise RuntimeError(f"{label}: summary.json has no state_bytes_per_rank (no optimiser step measured)")
    return RunResult(
        model, strategy.name, state["parameter_bytes"], state["gradient_bytes"], state["optimizer_bytes"],
        state["total_bytes"], state["total_bytes_by_rank"], summary["peak_memory_bytes"],
        summary["peak_memory_kind"], summary["step_seconds"], done.wall_seconds,
    )


# -------------------------------------------------------------- analysis
def with_ratios(runs: list[RunResult]) -> list[dict[str, Any]]:
    """Each run as a dict, with its total against the same model's DDP total (None without DDP)."""
    baseline = {r.model: r for r in runs if r.strategy == BASELINE}
    rows = []
    for r in runs:
        base = baseline.get(r.model)
        rows.append({**r.__dict__, "total_vs_ddp": r.total_bytes / base.total_bytes if base else None,
                     "step_vs_ddp": r.step_seconds / base.step_seconds if base else None})
    return rows


def results_table(rows: list[dict[str, Any]], nproc: int, precision: str) -> Table:
    table = Table(title=f"Training state on the largest of {nproc} ranks, before the 2nd optimiser step "
                        f"(MB = 10^6 bytes; AdamW, {precision})")
    for header in ("model", "strategy", "parameters MB", "gradients MB", "optimiser MB", "total MB", "total / DDP",
                   "step ms", "step / DDP"):
        table.add_column(header, justify="left" if header in ("model", "strategy") else "right", no_wrap=True)
    previous = None
    for row in rows:
        table.add_row(
            row["model"] if row["model"] != previous else "",
            row["strategy"],
            f"{row['parameter_bytes'] / MB:.1f}",
            f"{row['gradient_bytes'] / MB:.1f}",
            f"{row['optimizer_bytes'] / MB:.1f}",
            f"{row['total_bytes'] / MB:.1f}",
            f"{row['total_vs_ddp']:.2f}" if row["total_vs_ddp"] is not None else "n/a",
            f"{row['step_seconds'] * 1e3:.0f}",
            f"{row['step_vs_ddp']:.2f}" if row["step_vs_ddp"] is not None else "n/a",
        )
        previous = row["model"]
    return table


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated nodescale models (default {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help=f"comma-separated, of: {', '.join(STRATEGIES)} (default: all but zero-0; keep ddp "
                             "for the ratios)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                        help="--precision of every run (default fp32)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per process per step (default 8)")
    parser.add_argument("--steps", type=int, default=6,
                        help=f"optimiser steps per run, more than the {WARMUP_STEPS} warm-up steps (default 6)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process (default 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep every run's log and run dir here")
    args = parser.parse_args(argv)
    unknown = [name for name in args.strategies.split(",") if name not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategy(ies) {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than {WARMUP_STEPS}: the step time is measured after the warm-up")
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = wide_console(120)
    models = [m for m in args.models.split(",") if m]
    strategies = [STRATEGIES[name] for name in args.strategies.split(",")]
    started = time.perf_counter()
    info = machine("deepspeed")
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="nodescale-memory-") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for model in models:
            for strategy in strategies:
                result = run_one(model, strategy, args, workdir)
                runs.append(result)
                console.print(f"{model:<10} {strategy.name:<13} total {result.total_bytes / MB:8.1f} MB  "
                              f"(wall {result.wall_seconds:.1f} s)")
    rows = with_ratios(runs)
    console.print(results_table(rows, args.nproc, args.precision))
    elapsed = time.perf_counter() - started
    console.print(f"total time {elapsed:.0f} s")

    write_results(args.out, info, {
        "nproc": args.nproc,
        "omp_num_threads": args.threads,
        "run": {"dataset": "synthetic", "image_size": 32, "optimizer": "adamw", "precision": args.precision,
                "batch_size_per_process": args.batch_size, "steps": args.steps},
        "units": {"*_bytes": "bytes", "table": "MB = 10^6 bytes", "step_seconds": "seconds per optimiser step",
                  "total_vs_ddp": "total_bytes / the same model's DDP total_bytes, same invocation"},
        "measured": "state_bytes_per_rank of summary.json: parameters, gradients and optimiser state "
                    "(incl. DeepSpeed's fp32 master copy) of the largest rank, before the 2nd optimiser step; "
                    "activations and transiently gathered parameters are not included",
        "strategies": {s.name: {"flags": list(s.flags), "deepspeed_config": s.deepspeed_config,
                                "description": s.description} for s in strategies},
        "results": rows,
        "total_seconds": elapsed,
    }, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
