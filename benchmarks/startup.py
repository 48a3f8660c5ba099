"""Start-up and whole-job time of the embedded default job: nodescale, raw torchrun, Lightning, Accelerate.

Four sides train the same job -- the embedded default of ``nodescale train``: nodescale's ``cnn``
on the sklearn digits (80/20 split), ``--epochs`` epochs (default 10), batch 32 per process,
AdamW lr 3e-3 with a per-step cosine decay, validation once per epoch -- in 2 processes on the
CPU with the same ``OMP_NUM_THREADS``:

* ``nodescale``: ``python -m nodescale train --nproc 2 --epochs E --no-progress
  --set checkpoint.at_end=false`` (its own launcher);
* ``raw``: ``python -m torch.distributed.run --standalone --nproc-per-node 2
  benchmarks/raw_ddp.py`` (plain PyTorch DDP, the baseline);
* ``lightning``: ``python benchmarks/lightning_default.py`` (``Trainer(strategy="ddp")``
  starts the second process itself);
* ``accelerate``: ``python -m torch.distributed.run --standalone --nproc-per-node 2
  benchmarks/accelerate_default.py`` (``Accelerator(cpu=True)``).

Each repeat runs every side once, as a fresh subprocess of this script with the same
environment; the order rotates by one side per repeat (use a multiple of 4 repeats for every
side to take every position equally often), so a drift of the shared machine's load favours no
side. Two figures per run:

* **start-up**: the unix time at which global rank 0's first optimiser step returned, minus
  this script's unix time just before it started the command;
* **whole job**: the command's wall time, until every process of its session has exited.

"First optimiser step returned" is stamped the same way on every side, by torch's global
optimiser post-step hook, which ``startup_stamp/sitecustomize.py`` registers in every child
process (no side's code changes); each side's own stamp is kept beside it as a cross-check. From
the same stamps rank 0's start-up is cut into stages (``STAGES``), and the CPU time of the job's
Python processes is added up. Every run must reach ``--min-accuracy`` and rank 0 must take
``epochs x 23`` steps, else the harness stops. The fairness rules and the differences that
remain: README.md and the three scripts' docstrings.

    python benchmarks/startup.py                        # 8 repeats x 4 sides, 10 epochs
    python benchmarks/startup.py --repeats 3 --epochs 2 --sides nodescale,raw

Results go to ``benchmarks/results/startup.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    HERE,
    PAIRS,
    child_env,
    interleave,
    machine,
    nodescale_summary,
    result_line,
    run_logged,
    wide_console,
    write_results,
)

DEFAULT_OUT = HERE / "results" / "startup.json"
SIDES = ("nodescale", "raw", "lightning", "accelerate")
BASELINE = "raw"
STARTUP_MARGIN_S = 0.5  # target: nodescale's start-up within 0.5 s of raw's
MIN_VAL_ACCURACY = 0.9  # a side that trained nothing cannot reach it
DIGITS_SAMPLES = 1797
VAL_FRACTION = 0.2
BATCH_SIZE = 32
STAMP_VARIABLE = "STARTUP_STAMP_DIR"



@dataclass
class Run:
    """One run of one side."""

    side: str
    repeat: int
    position: int  # 0: the first side of its repeat
    launched: float  # unix time just before the command started
    first_step: float  # unix time of global rank 0's first optimiser step (the hook's)
    startup_seconds: float  # first_step - launched
    wall_seconds: float  # the whole command, until its session has no process left
    steps: int | None  # rank 0's optimiser steps, counted by the hook (None: its exit record is missing)
    val_accuracy: float
    native_first_step: float | None  # the side's own stamp of the same moment, where it has one
    stages: dict[str, float | None]  # where the start-up went: see STAGES
    processes: int  # Python processes that ran with the stamp module
    cpu_seconds: dict[str, float]  # CPU time of the job's Python processes: the cores it took from the others
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- commands
def expected_steps(epochs: int, nproc: int) -> int:
    """Optimiser steps of ``epochs`` epochs: the 80% training split, sharded, in batches of 32."""
    train = DIGITS_SAMPLES - min(max(round(DIGITS_SAMPLES * VAL_FRACTION), 1), DIGITS_SAMPLES - 1)
    return epochs * math.ceil(math.ceil(train / nproc) / BATCH_SIZE)


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def command(side: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    if side == "nodescale":
        cmd = [sys.executable, "-m", "nodescale", "train", "--nproc", str(args.nproc), "--epochs", str(args.epochs),
               "--out", str(run_dir / "run"), "--no-progress",
               # The other sides save nothing at the end; the embedded default would write a checkpoint.
               "--set", "checkpoint.at_end=false"]
        if args.nodescale_log_every is not None:
            cmd += ["--log-every", str(args.nodescale_log_every)]
        return cmd
    if side == "raw":  # the embedded default job; on the CPU like the two frameworks
        return [*torchrun(args.nproc), str(HERE / "raw_ddp.py"), "--epochs", str(args.epochs), "--device", "cpu"]
    if side == "lightning":
        return [sys.executable, str(HERE / "lightning_default.py"), "--nproc", str(args.nproc),
                "--epochs", str(args.epochs)]
    if side == "accelerate":
        return [*torchrun(args.nproc), str(HERE / "accelerate_default.py"), "--epochs", str(args.epochs)]
    raise ValueError(side)


# ---------------------------------------------------------------- running
def read_stamps(stamp_dir: Path) -> dict[int, dict[str, Any]]:
    """Each process's record by pid: its exit record where it wrote one, else its first-step record."""
    records: dict[int, dict[str, Any]] = {}
    for kind in ("first", "exit"):  # exit records are complete; they replace first-step ones
        for path in stamp_dir.glob(f"{kind}-*.json"):
            data = json.loads(path.read_text())
            records[int(data["pid"])] = {**data, "has_exit": kind == "exit"}
    return records


def native_first_step(side: str, run_dir: Path) -> tuple[float | None, float, dict[str, Any]]:
    """The side's own first-step stamp (None where it has none), its final validation accuracy, extras."""
    if side == "nodescale":
        summary = nodescale_summary(run_dir / "run")
        first = None
        for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "step":
                first = record["time"] if record["step"] == 1 else None  # only step 1 is the first step
                break
        extra = {"global_steps": summary["global_steps"], "epochs_completed": summary["epochs_completed"],
                 "nodescale_wall_seconds": summary["wall_seconds"]}
        return first, summary["val_accuracy"], extra
    result = result_line(run_dir.with_suffix(".log"))
    extra = {k: result[k] for k in ("steps", "epochs", "backend", "torch_threads", "world_size") if k in result}
    return result["first_step_time"], result["val_accuracy"], extra


def run_side(side: str, repeat: int, position: int, args: argparse.Namespace, workdir: Path) -> Run:
    run_dir = workdir / f"{side}-{repeat}"
    stamp_dir = run_dir / "stamps"
    stamp_dir.mkdir(parents=True)
    env = child_env(args.threads)
    env[STAMP_VARIABLE] = str(stamp_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE / "startup_stamp"), env.get("PYTHONPATH")) if p)
    done = run_logged(command(side, args, run_dir), env, run_dir.with_suffix(".log")).check()
    launched, wall = done.launched, done.wall_seconds

    records = read_stamps(stamp_dir)
    rank0 = [r for r in records.values() if r.get("rank") == 0 and r.get("first_step") is not None]
    if len(rank0) != 1:
        raise RuntimeError(f"{side} repeat {repeat}: {len(rank0)} processes stamped a first step as rank 0 "
                           f"(stamps in {stamp_dir})")
    r0 = rank0[0]
    native, accuracy, extra = native_first_step(side, run_dir)
    steps = r0["steps"] if r0["has_exit"] else None
    want = expected_steps(args.epochs, args.nproc)
    if accuracy is None or accuracy < args.min_accuracy:
        raise RuntimeError(f"{side} repeat {repeat}: validation accuracy {accuracy} < {args.min_accuracy}: "
                           "not the job (fewer --epochs need a lower --min-accuracy)")
    if steps is not None and steps != want:
        raise RuntimeError(f"{side} repeat {repeat}: rank 0 took {steps} optimiser steps, not {want}: not the job")
    return Run(
        side=side, repeat=repeat, position=position, launched=launched, first_step=r0["first_step"],
        startup_seconds=r0["first_step"] - launched, wall_seconds=wall, steps=steps, val_accuracy=accuracy,
        native_first_step=native, stages=stages(records, r0, launched), processes=len(records),
        cpu_seconds=cpu_seconds(records), extra=extra,
    )


def cpu_seconds(records: dict[int, dict[str, Any]]) -> dict[str, float]:
    """CPU time (user + system) of the job's Python processes at their exit: rank 0, the others, all."""
    done = [r for r in records.values() if r["has_exit"] and "cpu_seconds" in r]
    rank0 = sum(r["cpu_seconds"] for r in done if r.get("rank") == 0)
    total = sum(r["cpu_seconds"] for r in done)
    return {"rank0": rank0, "others": total - rank0, "all": total}


# Where rank 0's start-up goes, in order; each stage in seconds. "launcher" is the command's own
# process when it is not rank 0 (nodescale's launcher, torchrun's agent); Lightning has none.
STAGES = {
    "launcher_before_import_torch": "launcher: from the command's start to its `import torch`",
    "launcher_import_torch": "launcher: `import torch`",
    "launcher_to_rank0_start": "launcher: from torch imported to rank 0's interpreter running",
    "rank0_before_import_torch": "rank 0: from its start to its `import torch`",
    "rank0_import_torch": "rank 0: `import torch`",
    "rank0_torch_to_first_step": "rank 0: from torch imported to its first optimiser step returned",
    "last_rank_started": "(for reference) the last rank's interpreter ran, from the command's start",
}


def stages(records: dict[int, dict[str, Any]], r0: dict[str, Any], launched: float) -> dict[str, float | None]:
    """Rank 0's start-up cut at the stamps: the launcher's and rank 0's starts and ``import torch``."""

    def span(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else end - start

    ranks = [r for r in records.values() if r.get("first_step") is not None]
    launchers = [r for r in records.values() if r.get("first_step") is None and r.get("torch_import_started")]
    launcher = min(launchers, key=lambda r: r["started"]) if launchers else {}
    return {
        "launcher_before_import_torch": span(launched, launcher.get("torch_import_started")),
        "launcher_import_torch": span(launcher.get("torch_import_started"), launcher.get("torch_import_ended")),
        "launcher_to_rank0_start": span(launcher.get("torch_import_ended"), r0["started"] if launcher else None),
        "rank0_before_import_torch": span(r0["started"], r0.get("torch_import_started")),
        "rank0_import_torch": span(r0.get("torch_import_started"), r0.get("torch_import_ended")),
        "rank0_torch_to_first_step": span(r0.get("torch_import_ended"), r0["first_step"]),
        "last_rank_started": max(r["started"] for r in ranks) - launched,
    }


# ------------------------------------------------------------------ CLI start
def cli_timing(repeats: int) -> dict[str, Any]:
    """``nodescale --help`` wall time, an empty interpreter's, and ``-X importtime`` of ``nodescale.cli.main``."""
    exe = shutil.which("nodescale")
    help_cmd = [exe, "--help"] if exe else [sys.executable, "-m", "nodescale", "--help"]

    def wall(cmd: list[str]) -> float:
        started = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        return time.perf_counter() - started

    help_s = [wall(help_cmd) for _ in range(repeats)]
    python_s = [wall([sys.executable, "-c", "pass"]) for _ in range(repeats)]
    imports = subprocess.run([sys.executable, "-X", "importtime", "-c", "import nodescale.cli.main"],
                             capture_output=True, text=True, check=True).stderr
    rows = []
    for line in imports.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative_us, name = line.split(":", 1)[1].split("|")
        rows.append((int(cumulative_us), int(self_us), name.strip()))
    total = next((c for c, _, name in rows if name == "nodescale.cli.main"), None)
    heaviest = sorted(((c, name.strip()) for c, _, name in rows), reverse=True)[:12]  # nested ones included
    return {
        "help_command": shlex.join(help_cmd),
        "help_seconds": help_s,
        "help_seconds_median": statistics.median(help_s),
        "python_empty_seconds_median": statistics.median(python_s),
        "import_nodescale_cli_main_us": total,
        "heaviest_imports_cumulative_us": [{"module": name, "cumulative_us": c} for c, name in heaviest],
    }


# -------------------------------------------------------------- analysis
def summarise(runs: list[Run], sides: list[str]) -> dict[str, Any]:
    """Per side: medians, minima, and differences and ratios against the baseline's medians."""
    per_side: dict[str, Any] = {}
    for side in sides:
        mine = [r for r in runs if r.side == side]
        startup = [r.startup_seconds for r in mine]
        wall = [r.wall_seconds for r in mine]
        natives = [r.native_first_step - r.first_step for r in mine if r.native_first_step is not None]
        per_side[side] = {
            "startup_seconds": startup,
            "wall_seconds": wall,
            "startup_median": statistics.median(startup),
            "startup_min": min(startup),
            "wall_median": statistics.median(wall),
            "wall_min": min(wall),
            "val_accuracy": [r.val_accuracy for r in mine],
            "steps": [r.steps for r in mine],
            # The side's own stamp minus the hook's: how far the two definitions lie apart.
            "native_minus_hook_seconds": natives,
            "breakdown_median": breakdown(mine),
            "cpu_seconds_median": statistics.median(r.cpu_seconds["all"] for r in mine),
        }
    if BASELINE in per_side:
        base = per_side[BASELINE]
        by_repeat = {r.repeat: r for r in runs if r.side == BASELINE}
        for side, s in per_side.items():
            s["startup_diff_to_raw"] = s["startup_median"] - base["startup_median"]
            s["startup_ratio_to_raw"] = s["startup_median"] / base["startup_median"]
            s["wall_diff_to_raw"] = s["wall_median"] - base["wall_median"]
            s["wall_ratio_to_raw"] = s["wall_median"] / base["wall_median"]
            # Differences within a repeat, whose runs were close in time: the drift cancels.
            s["startup_paired_diffs"] = [r.startup_seconds - by_repeat[r.repeat].startup_seconds
                                         for r in runs if r.side == side and r.repeat in by_repeat]
            s["wall_paired_diffs"] = [r.wall_seconds - by_repeat[r.repeat].wall_seconds
                                      for r in runs if r.side == side and r.repeat in by_repeat]
            s["startup_paired_diff_median"] = statistics.median(s["startup_paired_diffs"])
            s["wall_paired_diff_median"] = statistics.median(s["wall_paired_diffs"])
            # A sign test against noise: in how many repeats this side started (finished) later than raw.
            s["startup_slower_than_raw"] = sum(d > 0 for d in s["startup_paired_diffs"])
            s["wall_slower_than_raw"] = sum(d > 0 for d in s["wall_paired_diffs"])
    return per_side


def breakdown(runs: list[Run]) -> dict[str, float | None]:
    """The median of each stage of rank 0's start-up (see STAGES)."""
    medians: dict[str, float | None] = {}
    for name in STAGES:
        kept: list[float] = [value for r in runs if (value := r.stages.get(name)) is not None]
        medians[name] = statistics.median(kept) if kept else None
    return medians


def checks(per_side: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of the issue: nodescale's start-up within 0.5 s of raw's, and below both frameworks'."""
    if "nodescale" not in per_side:
        return []
    ns = per_side["nodescale"]["startup_median"]
    found = []
    if BASELINE in per_side:
        diff = ns - per_side[BASELINE]["startup_median"]
        # Judged on the medians; the paired median and the minima are shown beside them because
        # on a shared machine they are steadier (load only ever adds time).
        paired = per_side["nodescale"]["startup_paired_diff_median"]
        minima = per_side["nodescale"]["startup_min"] - per_side[BASELINE]["startup_min"]
        found.append({"check": "start-up within 0.5 s of raw", "value": f"{diff:+.2f} s (paired {paired:+.2f} s, "
                      f"minima {minima:+.2f} s)", "target": f"<= +{STARTUP_MARGIN_S:.1f} s",
                      "passed": diff <= STARTUP_MARGIN_S})
    for framework in ("lightning", "accelerate"):
        if framework in per_side:
            other = per_side[framework]["startup_median"]
            found.append({"check": f"start-up faster than {framework}", "value": f"{ns:.2f} s vs {other:.2f} s",
                          "target": "<", "passed": ns < other})
    return found


def results_table(per_side: dict[str, Any], args: argparse.Namespace) -> Table:
    table = Table(title=f"Embedded default job, {args.epochs} epochs, {args.nproc} processes x {args.threads} "
                        f"thread(s); medians of {args.repeats} repeats (seconds, lower is better)")
    # "paired": the median over repeats of (this side - raw) within the same repeat, and in how
    # many repeats this side was the slower one; drift between repeats cancels there.
    for header in ("side", "start-up s", "min", "vs raw s", "/ raw", "paired vs raw s", "whole job s", "min",
                   "vs raw s", "/ raw", "paired vs raw s", "val acc (min)", "steps"):
        table.add_column(header, justify="left" if header == "side" else "right", no_wrap=True)
    nan = float("nan")
    for side, s in per_side.items():
        steps = sorted({x for x in s["steps"] if x is not None})
        pairs = len(s.get("startup_paired_diffs", []))
        table.add_row(
            side, f"{s['startup_median']:.2f}", f"{s['startup_min']:.2f}",
            f"{s.get('startup_diff_to_raw', nan):+.2f}", f"{s.get('startup_ratio_to_raw', nan):.2f}",
            f"{s.get('startup_paired_diff_median', nan):+.2f} ({s.get('startup_slower_than_raw', 0)}/{pairs} slower)",
            f"{s['wall_median']:.2f}", f"{s['wall_min']:.2f}",
            f"{s.get('wall_diff_to_raw', nan):+.2f}", f"{s.get('wall_ratio_to_raw', nan):.2f}",
            f"{s.get('wall_paired_diff_median', nan):+.2f} ({s.get('wall_slower_than_raw', 0)}/{pairs} slower)",
            f"{min(s['val_accuracy']):.3f}", ",".join(map(str, steps)) or "?",
        )
    return table


def breakdown_table(per_side: dict[str, Any]) -> Table:
    table = Table(title="Where rank 0's start-up went (medians, seconds; stages in order, the medians need not add "
                        "up; the last column: CPU time of the whole job's Python processes)")
    headers = ["launcher before torch", "launcher import torch", "launcher to rank 0", "rank 0 before torch",
               "rank 0 import torch", "rank 0 torch to step 1", "last rank started at", "CPU s, all processes"]
    table.add_column("side")
    for header in headers:
        table.add_column(header, justify="right")

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for side, s in per_side.items():
        table.add_row(side, *(fmt(s["breakdown_median"][name]) for name in STAGES), fmt(s["cpu_seconds_median"]))
    return table


def checks_table(found: list[dict[str, Any]]) -> Table:
    table = Table(title="Targets (nodescale's start-up)")
    for header in ("check", "value", "target", "result"):
        table.add_column(header)
    for c in found:
        table.add_row(c["check"], c["value"], c["target"], "[green]pass[/]" if c["passed"] else "[red]fail[/]")
    return table


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=PAIRS,
                        help=f"runs of each side (default {PAIRS}: with 4 sides every side takes every position twice)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of every run (default 10, the embedded default)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of: {', '.join(SIDES)}")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run, every side (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process, every side (default 1)")
    parser.add_argument("--nodescale-log-every", type=int, default=None,
                        help="pass --log-every to nodescale (1: its metrics.jsonl stamps step 1 as a cross-check; "
                             "default: the embedded default, 10)")
    parser.add_argument("--min-accuracy", type=float, default=MIN_VAL_ACCURACY,
                        help=f"final validation accuracy every run must reach (default {MIN_VAL_ACCURACY}; "
                             "1 epoch reaches about 0.89)")
    parser.add_argument("--cli-repeats", type=int, default=5, help="runs of `nodescale --help` to time (0: skip)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep every run's log, stamps and run dir here")
    args = parser.parse_args(argv)
    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        parser.error(f"unknown side(s) {', '.join(unknown)}; choose from {', '.join(SIDES)}")
    if args.repeats < 1 or args.epochs < 1:
        parser.error("--repeats and --epochs must be at least 1")
    args.side_list = sides
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = wide_console(200)
    started = time.perf_counter()
    info = machine("lightning", "accelerate")
    info["uptime_at_start"] = uptime()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="nodescale-startup-") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        # Untimed: load torch, the frameworks and nodescale from disk once, so that the first
        # timed run does not pay for a cold page cache that the later ones find warm.
        subprocess.run([sys.executable, "-c", "import torch, lightning, accelerate, nodescale.train.run"],
                       env=child_env(args.threads), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for repeat, _, order in interleave(args.repeats, [None], args.side_list):
            for position, side in enumerate(order):
                run = run_side(side, repeat, position, args, workdir)
                runs.append(run)
                native = ("" if run.native_first_step is None
                          else f"  (own stamp {run.native_first_step - run.first_step:+.3f} s)")
                console.print(f"repeat {repeat + 1}/{args.repeats}  {side:<10} start-up {run.startup_seconds:6.2f} s"
                              f"  whole job {run.wall_seconds:6.2f} s  val acc {run.val_accuracy:.3f}"
                              f"  steps {run.steps}{native}")
    per_side = summarise(runs, args.side_list)
    found = checks(per_side)
    console.print(results_table(per_side, args))
    console.print(checks_table(found))
    console.print(breakdown_table(per_side))
    cli = cli_timing(args.cli_repeats) if args.cli_repeats > 0 else None
    if cli is not None:
        console.print(f"`nodescale --help`: {cli['help_seconds_median']:.3f} s (median of {args.cli_repeats}; "
                      f"`python -c pass`: {cli['python_empty_seconds_median']:.3f} s); "
                      f"import nodescale.cli.main: {cli['import_nodescale_cli_main_us'] / 1e6:.3f} s (-X importtime)")
    info["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info["uptime_at_end"] = uptime()
    elapsed = time.perf_counter() - started
    console.print(f"total time {elapsed:.0f} s; load average at start {fmt_load(info['load_average_at_start'])}, "
                  f"at end {fmt_load(info['load_average_at_end'])}")

    write_results(args.out, info, {
        "nproc": args.nproc,
        "omp_num_threads": args.threads,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "expected_steps": expected_steps(args.epochs, args.nproc),
        "commands": {side: shlex.join(command(side, args, Path("RUN"))) for side in args.side_list},
        "definitions": {
            "startup_seconds": "unix time at which global rank 0's first optimiser step returned (torch's global "
                               "optimiser post-step hook) minus the parent's unix time just before starting "
                               "the command",
            "wall_seconds": "the command's wall time, until no process of its session is left",
        },
        "units": "seconds",
        "stages": STAGES,
        "startup_margin_seconds": STARTUP_MARGIN_S,
        "sides": per_side,
        "checks": found,
        "cli": cli,
        "runs": [asdict(r) for r in runs],
        "total_seconds": elapsed,
    }, console)
    return 0


def uptime() -> str | None:
    """``uptime``'s line, for the record of the machine's load."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def fmt_load(load: Any) -> str:
    return "?" if load is None else " / ".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    sys.exit(main())
