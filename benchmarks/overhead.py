"""nodescale's training-loop overhead against a hand-written DDP script, like for like.

Runs, in one invocation, repeated and interleaved pairs of

* ``benchmarks/raw_ddp.py`` under ``python -m torch.distributed.run --standalone``, and
* ``nodescale train --nproc N ... --set optim.schedule=constant``,

with the same model, data, per-process batch size, number of steps, warm-up
exclusion, process count and ``OMP_NUM_THREADS``, and compares the median
steady-state step time of each. nodescale's figure is ``step_seconds`` from its
``summary.json``; the raw script's is the same quantity measured between
barriers. The target is nodescale/raw <= 1.02.

Within a repeat the order of the two alternates (raw first, then nodescale
first, ...), so that a slow drift of the shared machine's load penalises
neither side systematically.

    python benchmarks/overhead.py                      # both cases, 4 repeats each
    python benchmarks/overhead.py --cases cnn-digits --repeats 5 --steps 500
    python benchmarks/overhead.py --face library       # the library calls (library_ddp.py) instead

Results go to ``benchmarks/results/overhead.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from record import cpu_model, stamp, wide_console, write_results  # noqa: E402

RAW_SCRIPT = HERE / "raw_ddp.py"
LIBRARY_SCRIPT = HERE / "library_ddp.py"  # raw_ddp.py's loop through nodescale.init/ctx calls (--face library)
DEFAULT_OUT = HERE / "results" / "overhead.json"
TARGET_RATIO = 1.02
UNBOUNDED_EPOCHS = 1_000_000

# Variables a launcher sets in its workers. If this script itself runs inside
# a distributed job, nodescale would take them as its own rank and never
# start its local processes; torchrun would inherit a stale rendezvous.
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)


@dataclass(frozen=True)
class Case:
    """One benchmark configuration, run identically by both sides."""

    name: str
    model: str
    dataset: str
    batch_size: int  # per process
    steps: int  # optimiser steps in total, warm-up included
    warmup_steps: int  # first steps excluded from the timing, on both sides
    image_size: int | None = None  # synthetic data only
    samples: int | None = None  # synthetic data only
    description: str = ""

    @property
    def timed_steps(self) -> int:
        return self.steps - self.warmup_steps


CASES: dict[str, Case] = {
    # Small steps (~10 ms on one core): per-step Python overhead shows up here.
    "cnn-digits": Case(
        "cnn-digits", "cnn", "digits", batch_size=32, steps=1000, warmup_steps=5,
        description="2-block CNN, sklearn 8x8 digits, batch 32/process",
    ),
    # Compute-bound steps (~1 s on one core): overhead should vanish here.
    "resnet18-synthetic32": Case(
        "resnet18-synthetic32", "resnet18", "synthetic", batch_size=16, steps=15, warmup_steps=3,
        image_size=32, samples=2048,
        description="ResNet-18 (CIFAR stem), random 3x32x32 images, batch 16/process",
    ),
}


@dataclass
class RunResult:
    """One training run of one side."""

    side: str  # "raw" or "nodescale"
    case: str
    repeat: int
    step_seconds: float
    samples_per_second: float
    timed_steps: int
    timed_samples: int
    wall_seconds: float  # the whole subprocess: start-up, training, evaluation, shutdown


# ---------------------------------------------------------------- running
def child_env(threads: int) -> dict[str, str]:
    """The environment of both sides: same thread count, no inherited launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    # Set explicitly for both: nodescale's launcher would otherwise pick cores // nproc
    # and torchrun 1, a difference that has nothing to do with the training loop.
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def raw_command(case: Case, nproc: int, json_out: Path, script: Path = RAW_SCRIPT) -> list[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        str(script),
        "--model", case.model, "--dataset", case.dataset, "--batch-size", str(case.batch_size),
        "--steps", str(case.steps), "--warmup-steps", str(case.warmup_steps), "--json-out", str(json_out),
    ]
    if case.image_size is not None:
        cmd += ["--image-size", str(case.image_size)]
    if case.samples is not None:
        cmd += ["--samples", str(case.samples)]
    return cmd


def nodescale_command(case: Case, nproc: int, run_dir: Path) -> list[str]:
    cmd = [
        sys.executable, "-m", "nodescale", "train", "--nproc", str(nproc),
        "--model", case.model, "--dataset", case.dataset, "--batch-size", str(case.batch_size),
        # nodescale stops at whichever comes first, epochs (default 10) or max-steps; the raw
        # script knows only steps, so the epoch limit must never be the one that binds.
        "--max-steps", str(case.steps), "--epochs", str(UNBOUNDED_EPOCHS),
        "--out", str(run_dir), "--no-progress",
        "--set", "optim.schedule=constant",  # the raw script's learning rate is constant too
        "--set", f"train.timing_warmup_steps={case.warmup_steps}",
        # The final checkpoint is outside the timed region; skipping it only saves wall time.
        "--set", "checkpoint.at_end=false",
    ]
    if case.image_size is not None:
        cmd += ["--set", f"data.image_size={case.image_size}"]
    if case.samples is not None:
        cmd += ["--set", f"data.samples={case.samples}"]
    return cmd


def run_logged(cmd: list[str], env: dict[str, str], log: Path) -> float:
    """Run ``cmd`` with its output in ``log``; return its wall time. Raises with the log's tail on failure."""
    started = time.perf_counter()
    with log.open("w") as handle:
        handle.write("$ " + shlex.join(cmd) + "\n")
        handle.flush()
        proc = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=HERE.parent)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"exit code {proc.returncode}: {shlex.join(cmd)}\n{tail}")
    return wall


def run_raw(case: Case, repeat: int, nproc: int, threads: int, workdir: Path) -> RunResult:
    json_out = workdir / f"raw-{case.name}-{repeat}.json"
    wall = run_logged(raw_command(case, nproc, json_out), child_env(threads), json_out.with_suffix(".log"))
    data = json.loads(json_out.read_text())
    return RunResult("raw", case.name, repeat, data["step_seconds"], data["samples_per_second"],
                     data["timed_steps"], data["timed_samples"], wall)


def run_library(case: Case, repeat: int, nproc: int, threads: int, workdir: Path) -> RunResult:
    """The "nodescale" side of ``--face library``: the raw loop written with the library's calls."""
    json_out = workdir / f"library-{case.name}-{repeat}.json"
    wall = run_logged(raw_command(case, nproc, json_out, LIBRARY_SCRIPT), child_env(threads),
                      json_out.with_suffix(".log"))
    data = json.loads(json_out.read_text())
    return RunResult("nodescale", case.name, repeat, data["step_seconds"], data["samples_per_second"],
                     data["timed_steps"], data["timed_samples"], wall)


def run_nodescale(case: Case, repeat: int, nproc: int, threads: int, workdir: Path) -> RunResult:
    run_dir = workdir / f"nodescale-{case.name}-{repeat}"
    wall = run_logged(nodescale_command(case, nproc, run_dir), child_env(threads),
                      workdir / f"nodescale-{case.name}-{repeat}.log")
    data = json.loads((run_dir / "summary.json").read_text())
    if data.get("timing_includes_warmup"):
        raise RuntimeError(f"{case.name}: nodescale timed its warm-up too; use more --steps")
    return RunResult("nodescale", case.name, repeat, data["step_seconds"], data["samples_per_second"],
                     data["timed_steps"], data["timed_samples"], wall)


# -------------------------------------------------------------- analysis
def summarise(case: Case, runs: list[RunResult]) -> dict[str, Any]:
    """Medians, their ratio, the spread of the repeats and the paired ratios of one case."""
    raw = [r for r in runs if r.side == "raw"]
    ns = [r for r in runs if r.side == "nodescale"]
    raw_steps = [r.step_seconds for r in raw]
    ns_steps = [r.step_seconds for r in ns]
    raw_median, ns_median = statistics.median(raw_steps), statistics.median(ns_steps)
    ratio = ns_median / raw_median
    # Each repeat's two runs ran back to back, so their ratio cancels slow drift.
    by_repeat = {r.repeat: r.step_seconds for r in raw}
    paired = [n.step_seconds / by_repeat[n.repeat] for n in ns if n.repeat in by_repeat]
    # Same work on both sides: every run must have timed the same steps and samples.
    same_steps = len({r.timed_steps for r in runs}) == 1
    same_samples = len({r.timed_samples for r in runs}) == 1
    like_for_like = same_steps and same_samples
    return {
        "case": case.name,
        "description": case.description,
        "config": asdict(case),
        "raw_step_ms": [s * 1e3 for s in raw_steps],
        "nodescale_step_ms": [s * 1e3 for s in ns_steps],
        "raw_step_ms_median": raw_median * 1e3,
        "nodescale_step_ms_median": ns_median * 1e3,
        # Other tenants' load only ever adds time, so each side's fastest run is the
        # least disturbed estimate of its own cost: a second view beside the medians.
        "raw_step_ms_min": min(raw_steps) * 1e3,
        "nodescale_step_ms_min": min(ns_steps) * 1e3,
        "ratio_of_minima": min(ns_steps) / min(raw_steps),
        "raw_samples_per_second_median": statistics.median(r.samples_per_second for r in raw),
        "nodescale_samples_per_second_median": statistics.median(r.samples_per_second for r in ns),
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "passed": ratio <= TARGET_RATIO and like_for_like,
        # (max - min) / median of each side's repeats: how far apart identical runs land.
        "raw_spread": (max(raw_steps) - min(raw_steps)) / raw_median,
        "nodescale_spread": (max(ns_steps) - min(ns_steps)) / ns_median,
        "paired_ratios": paired,
        # In how many back-to-back pairs nodescale was the slower one: a sign test against noise.
        "nodescale_slower_pairs": sum(r > 1.0 for r in paired),
        "same_timed_steps": same_steps,
        "same_timed_samples": same_samples,
        "like_for_like": like_for_like,
    }


def results_table(summaries: list[dict[str, Any]], nproc: int, threads: int) -> Table:
    table = Table(title=f"Step time, {nproc} processes x {threads} thread(s); median of repeats "
                        "(ms = milliseconds per optimiser step, lower is better)")
    for header, justify in [("case", "left"), ("raw step ms (median)", "right"),
                            ("nodescale step ms (median)", "right"), ("ratio nodescale/raw", "right"),
                            ("target", "right"), ("result", "center"), ("raw spread", "right"),
                            ("nodescale spread", "right"), ("paired ratios", "right"),
                            ("nodescale slower", "right"), ("ratio of minima", "right")]:
        table.add_column(header, justify=justify, no_wrap=header == "case")  # type: ignore[arg-type]
    for s in summaries:
        table.add_row(
            s["case"],
            f"{s['raw_step_ms_median']:.2f}",
            f"{s['nodescale_step_ms_median']:.2f}",
            f"{s['ratio']:.3f}",
            f"<= {s['target_ratio']:.2f}",
            "[green]pass[/]" if s["passed"] else ("[red]fail[/]" if s["like_for_like"] else "[red]invalid[/]"),
            f"{s['raw_spread']:.1%}",
            f"{s['nodescale_spread']:.1%}",
            f"{min(s['paired_ratios']):.3f}-{max(s['paired_ratios']):.3f}",
            f"{s['nodescale_slower_pairs']}/{len(s['paired_ratios'])} pairs",
            f"{s['ratio_of_minima']:.3f}",
        )
    return table


def machine() -> dict[str, Any]:
    import torch  # only for its version; the children import it themselves

    cpu = cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cores": cores,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Even, so that each side goes first equally often (raw/ns, ns/raw, ...).
    parser.add_argument("--repeats", type=int, default=4, help="runs of each side per case (default 4)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimiser steps per run, warm-up included, for every case "
                             "(default: per case, " + ", ".join(f"{c.name} {c.steps}" for c in CASES.values()) + ")")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run, both sides (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process, both sides (default 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    parser.add_argument("--face", choices=("train", "library"), default="train",
                        help="nodescale's side: `nodescale train` (default) or the library calls (library_ddp.py)")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep every run's log and run dir here")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = wide_console(190)
    cases = [CASES[name] for name in args.cases.split(",")]
    if args.steps is not None:
        cases = [replace(c, steps=args.steps) for c in cases]
    for case in cases:
        if case.steps <= case.warmup_steps:
            console.print(f"[red]{case.name}: --steps {case.steps} leaves no timed step after "
                          f"{case.warmup_steps} warm-up steps[/]")
            return 2
    started = time.perf_counter()
    info = machine()
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="nodescale-overhead-") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            for case in cases:
                # Alternate which side goes first, so drift favours neither.
                ours = run_library if args.face == "library" else run_nodescale
                sides = [run_raw, ours] if repeat % 2 == 0 else [ours, run_raw]
                for run in sides:
                    result = run(case, repeat, args.nproc, args.threads, workdir)
                    runs.append(result)
                    console.print(
                        f"repeat {repeat + 1}/{args.repeats}  {case.name:<22} {result.side:<9} "
                        f"{result.step_seconds * 1e3:9.2f} ms/step  {result.samples_per_second:9.1f} samples/s  "
                        f"(wall {result.wall_seconds:.1f} s)"
                    )
    summaries = [summarise(case, [r for r in runs if r.case == case.name]) for case in cases]
    console.print(results_table(summaries, args.nproc, args.threads))
    for s in summaries:
        if not s["like_for_like"]:
            console.print(f"[red]{s['case']}: invalid comparison, the two sides timed different steps or "
                          "samples (see runs in the JSON)[/]")
    elapsed = time.perf_counter() - started
    console.print(f"total time {elapsed:.0f} s")

    record = {
        **stamp(),
        "machine": info,
        "face": args.face,
        "nproc": args.nproc,
        "omp_num_threads": args.threads,
        "repeats": args.repeats,
        "units": {"step_ms": "milliseconds per optimiser step (steady state, warm-up excluded)",
                  "samples_per_second": "samples per second over all ranks"},
        "target_ratio": TARGET_RATIO,
        "cases": summaries,
        "runs": [asdict(r) for r in runs],
        "total_seconds": elapsed,
    }
    write_results(args.out, record, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
