"""What observing a run costs: step time with ``--log tensorboard --monitor`` against without.

Runs, in one invocation, repeated and interleaved pairs of the same
``nodescale train`` job (the cases of ``overhead.py``: same model, data,
batch, steps, warm-up exclusion, processes and threads), once plain and once
with TensorBoard logging and the device monitor sampling every
``--monitor-interval`` seconds (default 1 s, five times the default rate, so
the sampler's cost is not hidden by sampling rarely). It compares the median
steady-state ``step_seconds`` of each side. Target: observed/plain <= 1.01.

Whole-run timings on a shared machine vary by more than 1% from run to run, so the observed
runs also account for their own cost: rank 0's time in the loggers' writes (``logger_seconds``
of summary.json) plus the monitor thread's CPU time (``monitor.sampler_cpu_seconds``), as a
fraction of the run's training time ("accounted cost"). That figure is precise; it leaves out
what cannot be attributed (a thread's effect on the main thread's caches, say).

    python benchmarks/observe_overhead.py                     # both cases, 8 repeats
    python benchmarks/observe_overhead.py --cases cnn-digits --repeats 6

Results go to ``benchmarks/results/observe_overhead.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    HERE,
    PAIRS,
    child_env,
    compare,
    interleave,
    machine,
    nodescale_summary,
    run_logged,
    span,
    wide_console,
    write_results,
)
from overhead_sides import CASES, Case, nodescale_command  # noqa: E402

DEFAULT_OUT = HERE / "results" / "observe_overhead.json"
TARGET_RATIO = 1.01
# overhead.py's cases but its framework comparison (cnn-synthetic28), which would only lengthen this run.
DEFAULT_CASES = "cnn-digits,resnet18-synthetic32,gpt-nano-pydoc"


@dataclass
class Run:
    side: str  # "plain" or "observed"
    case: str
    repeat: int
    step_seconds: float
    timed_steps: int
    timed_samples: int
    monitor_samples: int  # rows the monitor wrote (0 for plain runs)
    tensorboard_files: int  # event files written (0 for plain runs)
    # What the observing itself took, as the run accounted it (0 for plain runs): rank 0's time in the
    # loggers' writes, and the monitor thread's CPU time; against the training time of all its steps.
    logger_seconds: float
    sampler_cpu_seconds: float
    train_seconds: float


def observe_flags(interval: float) -> list[str]:
    return ["--log", "tensorboard", "--monitor", "--monitor-interval", str(interval)]


def run_side(side: str, case: Case, repeat: int, args: argparse.Namespace, workdir: Path) -> Run:
    run_dir = workdir / f"{side}-{case.name}-{repeat}"
    cmd = nodescale_command(case, args.nproc, run_dir)
    if side == "observed":
        cmd += observe_flags(args.monitor_interval)
    run_logged(cmd, child_env(args.threads), workdir / f"{side}-{case.name}-{repeat}.log").check()
    summary = nodescale_summary(run_dir)
    monitor_rows = sum(len(path.read_text().splitlines()) - 1 for path in run_dir.glob("monitor/*.csv"))
    events = len(list(run_dir.glob("tensorboard/events.out.tfevents.*")))
    if side == "observed" and (monitor_rows < 1 or events < 1):
        raise RuntimeError(f"{run_dir}: the observed run wrote no monitor rows or no TensorBoard events")
    monitor = summary.get("monitor") or {}
    return Run(side, case.name, repeat, summary["step_seconds"], summary["timed_steps"], summary["timed_samples"],
               monitor_rows, events, summary.get("logger_seconds", 0.0), monitor.get("sampler_cpu_seconds", 0.0),
               summary["step_seconds"] * case.steps)


def summarise(case: Case, runs: list[Run]) -> dict[str, Any]:
    ms = {side: {r.repeat: r.step_seconds * 1e3 for r in runs if r.side == side} for side in ("plain", "observed")}
    found = compare("plain", ms["plain"], "observed", ms["observed"], "step_ms")
    like_for_like = len({(r.timed_steps, r.timed_samples) for r in runs}) == 1
    return {
        "case": case.name,
        "description": case.description,
        **found,
        "monitor_rows_per_run": [r.monitor_samples for r in runs if r.side == "observed"],
        # The cost as the observed runs accounted it: precise where whole-run timings are noise.
        "accounted_fraction": statistics.median((r.logger_seconds + r.sampler_cpu_seconds) / r.train_seconds
                                                for r in runs if r.side == "observed"),
        "logger_ms_per_run": [r.logger_seconds * 1e3 for r in runs if r.side == "observed"],
        "sampler_cpu_ms_per_run": [r.sampler_cpu_seconds * 1e3 for r in runs if r.side == "observed"],
        "target_ratio": TARGET_RATIO,
        "like_for_like": like_for_like,
        "passed": like_for_like and found["ratio"] <= TARGET_RATIO,
    }


def table(summaries: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    result = Table(title=f"Step time with --log tensorboard --monitor (every {args.monitor_interval} s) against "
                         f"without; {args.nproc} processes x {args.threads} thread(s), median of {args.repeats} "
                         "(ms per optimiser step)")
    for header in ("case", "plain ms", "observed ms", "ratio", "target", "result", "paired ratios",
                   "observed slower", "ratio of minima", "accounted cost"):
        result.add_column(header, justify="left" if header == "case" else "right")
    for s in summaries:
        result.add_row(
            s["case"], f"{s['plain_step_ms_median']:.2f}", f"{s['observed_step_ms_median']:.2f}", f"{s['ratio']:.3f}",
            f"<= {s['target_ratio']:.2f}",
            "[green]pass[/]" if s["passed"] else "[red]fail[/]" if s["like_for_like"] else "[red]invalid[/]",
            span(s["paired_ratios"]),
            f"{s['observed_slower_pairs']}/{len(s['paired_ratios'])} pairs", f"{s['ratio_of_minima']:.3f}",
            f"{s['accounted_fraction']:.2%}",
        )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=PAIRS, help=f"runs of each side per case (default {PAIRS})")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps per run (default: per case)")
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process (default 1)")
    parser.add_argument("--monitor-interval", type=float, default=1.0, help="monitor sampling interval, s")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep every run's log and run dir here")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = wide_console(190)
    cases = [CASES[name] for name in args.cases.split(",")]
    if args.steps is not None:
        cases = [replace(c, steps=args.steps) for c in cases]
    started = time.perf_counter()
    info = machine()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="nodescale-observe-") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for repeat, case, sides in interleave(args.repeats, cases, ["plain", "observed"]):
            for side in sides:
                run = run_side(side, case, repeat, args, workdir)
                runs.append(run)
                console.print(f"repeat {repeat + 1}/{args.repeats}  {case.name:<22} {side:<9} "
                              f"{run.step_seconds * 1e3:9.2f} ms/step  monitor rows {run.monitor_samples}")
    summaries = [summarise(case, [r for r in runs if r.case == case.name]) for case in cases]
    console.print(table(summaries, args))
    write_results(args.out, info, {
        "nproc": args.nproc,
        "omp_num_threads": args.threads,
        "monitor_interval_s": args.monitor_interval,
        "units": {"step_ms": "milliseconds per optimiser step (steady state, warm-up excluded)"},
        "cases": summaries,
        "runs": [asdict(r) for r in runs],
        "total_seconds": time.perf_counter() - started,
    }, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
