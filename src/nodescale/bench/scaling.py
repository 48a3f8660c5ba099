"""``nodescale bench scaling``: train at each world size, then tabulate and plot the scaling.

Each world size is an ordinary ``nodescale train --nproc N`` run in its own
directory ``OUT/ws-N`` (one after the other, so runs never share the
machine). Everything reported is then read back from those runs'
``summary.json`` files, so runs made elsewhere (one cluster job per world
size) are analysed the same way (:func:`collect`).

Outputs: ``OUT/scaling.json`` (settings, per-world-size rows, notes),
``OUT/scaling.csv`` (the rows) and ``OUT/scaling.png`` (the plot).
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescale.atomic_files import write_json_atomic, write_text_atomic
from nodescale.bench import peaks, scaling_math
from nodescale.bench.scaling_math import Measurement, Mode
from nodescale.errors import UserError

RUN_PREFIX = "ws-"
# Settings nodescale bench scaling decides for every run; the user may not override them after --.
CONTROLLED_KEYS = (
    "train.batch_size", "train.max_steps", "train.timing_warmup_steps", "train.epochs", "strategy.nproc", "out",
    "checkpoint.resume", "checkpoint.at_end",
)
CSV_COLUMNS = (
    "world_size", "devices", "batch_size_per_process", "global_batch_size", "samples_per_second",
    "samples_per_second_per_device", "speedup", "ideal_speedup", "efficiency", "step_ms", "timed_steps",
    "achieved_tflops", "mfu", "oversubscribed", "run_dir",
)
UNITS = {
    "samples_per_second": "samples/s, all processes, warm-up excluded",
    "step_ms": "milliseconds per optimiser step, slowest rank",
    "speedup": "throughput / throughput of the base world size",
    "efficiency": "speedup / (world_size / base world size), 1.0 = ideal",
    "achieved_tflops": "1e12 FLOP/s, 3 x forward FLOPs per sample x samples/s",
    "mfu": "achieved FLOP/s / (peak FLOP/s per device x devices), 0..1; null = unknown",
}


class TrainingFailed(Exception):
    """``nodescale train`` at one world size exited with an error; its output is in ``log``."""

    def __init__(self, world_size: int, code: int, log: Path) -> None:
        self.world_size, self.code, self.log = world_size, code, log
        super().__init__(f"training at world size {world_size} failed (exit code {code}); output in {log}")


@dataclass(frozen=True)
class ScalingPlan:
    """What to run: world sizes, mode, steps, batch, and the flags passed on to ``nodescale train``."""

    out: Path
    world_sizes: tuple[int, ...]
    mode: Mode
    batch_size: int  # strong: the global batch; weak: each process's batch
    max_steps: int
    warmup_steps: int
    train_args: tuple[str, ...] = ()  # --model, --dataset, --strategy and anything given after --

    def run_dir(self, world_size: int) -> Path:
        """Where the run at ``world_size`` writes (``OUT/ws-N``)."""
        return self.out / f"{RUN_PREFIX}{world_size}"

    def train_argv(self, world_size: int) -> list[str]:
        """The ``nodescale`` arguments that train at ``world_size``."""
        batch = scaling_math.per_process_batch(self.batch_size, world_size, self.mode)
        return [
            "train", *self.train_args,
            "--nproc", str(world_size), "--batch-size", str(batch), "--max-steps", str(self.max_steps),
            "--set", f"train.timing_warmup_steps={self.warmup_steps}",
            # --max-steps, not the epoch count, must end every run, whatever the dataset's size.
            "--epochs", "1000000",
            # The final checkpoint is not timed but costs wall time and disk; a benchmark needs none.
            "--set", "checkpoint.at_end=false",
            "--no-progress", "--out", str(self.run_dir(world_size)),
        ]


def check_train_args(args: Sequence[str], flag_names: dict[str, str]) -> None:
    """Refuse flags after ``--`` that would change what the benchmark controls (batch, steps, processes...)."""
    controlled = {flag_names[key]: key for key in CONTROLLED_KEYS if key in flag_names}
    for index, token in enumerate(args):
        name, _, inline = token.partition("=")
        key = controlled.get(name)
        if name == "--set":  # --set KEY=VALUE or --set=KEY=VALUE
            assignment = inline or (args[index + 1] if index + 1 < len(args) else "")
            assigned = assignment.partition("=")[0].strip()
            key = assigned if assigned in CONTROLLED_KEYS else None
        if key is not None:
            raise UserError(f"train flag {token!r} after --", "is set by nodescale bench scaling for every run",
                            "use --batch-size, --max-steps, --warmup-steps or --world-sizes of bench scaling")


def local_capacity() -> tuple[int, str]:
    """How many processes this machine runs without sharing a device: its GPUs, or else its CPU cores."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPUs"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, "CPU cores"


def default_world_sizes() -> list[int]:
    """1, 2, 4, ... up to this machine's GPUs (or CPU cores), and at least ``[1, 2]``."""
    capacity, _ = local_capacity()
    sizes = [1]
    while sizes[-1] * 2 <= max(2, capacity):
        sizes.append(sizes[-1] * 2)
    return sizes


def run_world_size(plan: ScalingPlan, world_size: int) -> dict[str, Any]:
    """Train at ``world_size`` in a child ``nodescale train``; return its summary.

    The child's output goes to ``OUT/ws-N/train.log``. A child that fails
    raises :class:`TrainingFailed`.
    """
    run_dir = plan.run_dir(world_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "train.log"
    command = [sys.executable, "-m", "nodescale", *plan.train_argv(world_size)]
    with open(log, "w", encoding="utf-8") as handle:
        handle.write(f"$ nodescale {' '.join(command[3:])}\n")
        handle.flush()
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if code != 0:
        raise TrainingFailed(world_size, code, log)
    return read_summary(run_dir)


def read_summary(run_dir: Path) -> dict[str, Any]:
    """A run's ``summary.json``; a missing or unreadable one is a ``UserError``."""
    path = run_dir / "summary.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}", "does not exist", "the run did not finish; see train.log beside it") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}", f"cannot be read as JSON ({exc})", "re-run that world size") from None


def find_runs(out: Path) -> dict[int, Path]:
    """The finished runs in ``out`` (``ws-*/summary.json``), by the world size their summary states."""
    runs: dict[int, Path] = {}
    for run_dir in sorted(out.glob(f"{RUN_PREFIX}*")):
        if not (run_dir / "summary.json").is_file():
            continue
        world_size = int(read_summary(run_dir)["world_size"])
        if world_size in runs:
            raise UserError(f"{run_dir}", f"is a second run at world size {world_size} (after {runs[world_size]})",
                            "keep one ws-N directory per world size")
        runs[world_size] = run_dir
    return runs


def training_flops_per_sample(run_dir: Path) -> tuple[int | None, str | None]:
    """Training FLOPs per sample (3 x forward) of the run's model, or ``None`` and the reason.

    The model is rebuilt from the run's ``config.yaml`` on the meta device
    (no memory, no arithmetic); the dataset is opened once for its sample
    shape. Any failure (a dataset not reachable from here) leaves the FLOPs,
    and so the MFU, unknown.
    """
    try:
        import torch

        from nodescale.config.load import load_config
        from nodescale.data.registry import get_format
        from nodescale.models.introspect import training_flops_per_sample as count
        from nodescale.models.registry import build_model

        cfg = load_config(run_dir / "config.yaml")
        data_format = get_format(cfg.data.name)
        data_format.prepare(cfg.data)
        spec = data_format.load(cfg.data, cfg.train.seed).spec
        with torch.device("meta"):
            model = build_model(cfg.model, spec)
        return count(model, spec), None
    except Exception as exc:  # any failure only makes the MFU unknown; the reason is recorded
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"FLOPs not counted: {first_line}"


def collect(
    out: Path,
    mode: Mode | None = None,
    peak_choice: str = "auto",
    capacity: tuple[int, str] | None = None,
    world_sizes: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The scaling result of the runs in ``out`` (``ws-N/summary.json``): what ``scaling.json`` holds.

    ``mode`` None: inferred from the batches (same global batch: strong; same
    per-process batch: weak). ``capacity`` (GPUs or cores of the machine that
    ran them) marks oversubscribed rows; None when unknown (runs made
    elsewhere). ``world_sizes`` restricts to those runs (all must exist).
    """
    runs = find_runs(out)
    if world_sizes is not None:
        missing = [n for n in world_sizes if n not in runs]
        if missing:
            raise UserError(f"{out}", f"has no finished run at world size {', '.join(map(str, missing))}",
                            f"expected {out}/{RUN_PREFIX}N/summary.json for each world size")
        runs = {n: runs[n] for n in world_sizes}
    if not runs:
        raise UserError(f"{out}", f"holds no finished runs ({RUN_PREFIX}N/summary.json)",
                        "run nodescale bench scaling --out DIR, or put one run per world size in DIR/ws-N")
    summaries = {n: read_summary(path) for n, path in sorted(runs.items())}
    mode = _check_mode(out, mode, summaries)
    base = summaries[min(summaries)]
    flops, flops_note = training_flops_per_sample(runs[min(runs)])
    device = base.get("device")
    entry = peaks.find_peak(device)
    dtype = peaks.peak_dtype(str(base.get("precision", "fp32")), entry, peak_choice)
    peak_flops = entry.flops(dtype) if entry else None
    kept = "global_batch_size" if mode == "strong" else "batch_size_per_process"  # what the mode holds fixed
    rows = _rows(summaries, runs, out, flops, peak_flops, capacity)
    notes = _notes(summaries, rows, capacity)
    mfu_note = _mfu_note(device, entry, dtype, peak_flops, flops, flops_note)
    if mfu_note:
        notes.append(mfu_note)
    return {
        "benchmark": "scaling",
        "mode": mode,
        "base_world_size": min(summaries),
        "settings": {
            "model": base.get("model"), "dataset": base.get("dataset"), "strategy": base.get("strategy"),
            "precision": base.get("precision"), "timing_warmup_steps": base.get("timing_warmup_steps"),
            "optimiser_steps": base.get("global_steps"), kept: base.get(kept),
        },
        "device": device,
        "capacity": None if capacity is None else {"count": capacity[0], "kind": capacity[1]},
        "training_flops_per_sample": flops,
        "peak": None if peak_flops is None or entry is None else {
            "device": device, "dtype": dtype, "tflops": entry.tflops[dtype], "source": entry.source,
        },
        "rows": rows,
        "notes": notes,
        "units": UNITS,
    }


def _check_mode(out: Path, mode: Mode | None, summaries: dict[int, dict[str, Any]]) -> Mode:
    batches = [(int(s["batch_size_per_process"]), int(s["global_batch_size"])) for s in summaries.values()]
    described = "; ".join(f"world size {n}: {b} per process, {g} global"
                          for n, (b, g) in zip(summaries, batches, strict=True))
    if mode is None:
        inferred = scaling_math.infer_mode(batches)
        if inferred is None:
            raise UserError(f"the runs in {out} ({described})",
                            "keep neither the global batch (strong scaling) nor the per-process batch (weak)",
                            "compare runs made with one --mode of nodescale bench scaling")
        return inferred
    if not scaling_math.fits_mode(mode, batches):
        kept = "global batch" if mode == "strong" else "per-process batch"
        raise UserError(f"--mode {mode} for the runs in {out} ({described})", f"{mode} scaling keeps the {kept} fixed",
                        "pass the --mode the runs were made with, or leave --mode out to infer it")
    return mode


def _rows(
    summaries: dict[int, dict[str, Any]],
    runs: dict[int, Path],
    out: Path,
    flops: int | None,
    peak_flops: float | None,
    capacity: tuple[int, str] | None,
) -> list[dict[str, Any]]:
    measured = [Measurement(n, s.get("samples_per_second"), s.get("step_seconds")) for n, s in summaries.items()]
    rows = []
    for row in scaling_math.scaling_rows(measured):
        summary = summaries[row.world_size]
        devices = int(summary.get("devices") or row.world_size)
        achieved = scaling_math.achieved_flops(row.samples_per_second, flops)
        rows.append({
            "world_size": row.world_size,
            "devices": devices,
            "batch_size_per_process": summary.get("batch_size_per_process"),
            "global_batch_size": summary.get("global_batch_size"),
            "samples_per_second": row.samples_per_second,
            "samples_per_second_per_device": summary.get("samples_per_second_per_device"),
            "speedup": row.speedup,
            "ideal_speedup": row.ideal_speedup,
            "efficiency": row.efficiency,
            "step_ms": None if row.step_seconds is None else row.step_seconds * 1000,
            "timed_steps": summary.get("timed_steps"),
            "achieved_tflops": None if achieved is None else achieved / 1e12,
            "mfu": scaling_math.mfu(row.samples_per_second, flops, peak_flops, devices),
            "oversubscribed": None if capacity is None else row.world_size > capacity[0],
            "device": summary.get("device"),
            "run_dir": os.path.relpath(runs[row.world_size], out),
        })
    return rows


def _notes(summaries: dict[int, dict[str, Any]], rows: list[dict[str, Any]],
           capacity: tuple[int, str] | None) -> list[str]:
    """Caveats of these numbers a reader must know: oversubscription, superlinearity, short timing."""
    notes = []
    if capacity is not None:
        over = [row["world_size"] for row in rows if row["oversubscribed"]]
        if over:
            notes.append(f"world size {', '.join(map(str, over))} exceeds this machine's {capacity[0]} {capacity[1]}: "
                         "processes share them, so those rows measure contention, not scaling")
    superlinear = [row["world_size"] for row in rows if row["efficiency"] is not None and row["efficiency"] > 1.1]
    if superlinear:
        notes.append(f"efficiency above 100% at world size {', '.join(map(str, superlinear))}: more than linear "
                     "speedup usually means the base run was held back (contention, thread oversubscription, "
                     "too few timed steps) or the per-process batch now fits a cache; check the base run")
    short = [n for n, s in summaries.items() if s.get("timing_includes_warmup")]
    if short:
        notes.append(f"world size {', '.join(map(str, short))}: too few steps to exclude warm-up from timing")
    devices = {s.get("device") for s in summaries.values()}
    if len(devices) > 1:
        notes.append(f"the runs used different devices ({', '.join(sorted(map(str, devices)))}); MFU uses the first")
    return notes


def _mfu_note(device: str | None, entry: peaks.DevicePeak | None, dtype: str, peak_flops: float | None,
              flops: int | None, flops_note: str | None) -> str | None:
    if flops is None:
        return f"MFU unknown: {flops_note}"
    if entry is None:
        return f"MFU unknown: no peak for device {device!r} in the peak table (nodescale/bench/peaks.yaml)"
    if peak_flops is None:
        return f"MFU unknown: the peak table has no {dtype} peak for {device!r}"
    return None


def rows_csv(result: dict[str, Any]) -> str:
    """The rows of ``result`` as CSV (empty cells for unknown values)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in result["rows"]:
        writer.writerow({key: "" if row.get(key) is None else row[key] for key in CSV_COLUMNS})
    return buffer.getvalue()


def write_outputs(out: Path, result: dict[str, Any]) -> list[Path]:
    """Write ``scaling.json``, ``scaling.csv`` and ``scaling.png`` into ``out``; return their paths."""
    from nodescale.bench.scaling_plot import plot_scaling, save_png

    paths = [out / "scaling.json", out / "scaling.csv", out / "scaling.png"]
    write_json_atomic(paths[0], result)
    write_text_atomic(paths[1], rows_csv(result))
    save_png(plot_scaling(result), paths[2])
    return paths


def cpu_threads_note(cores: int) -> str:
    """How the cores were shared among the processes of a CPU run (nodescale train's thread rule)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        return (f"CPU runs with OMP_NUM_THREADS={threads}: every process used {threads} thread(s), so N processes "
                f"used up to N x {threads} of the {cores} cores")
    return (f"CPU runs: 1 process used all {cores} cores through threads, N processes cores / N threads each "
            "(nodescale train's OMP_NUM_THREADS), so the cores in use are the same at every world size; set "
            "OMP_NUM_THREADS=1 to measure one core per process")


def load_average() -> float | None:
    """This machine's 1-minute load average (runnable processes), or ``None`` where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run_all(plan: ScalingPlan, echo: Callable[[str], None], peak_choice: str = "auto") -> dict[str, Any]:
    """Train every world size of ``plan`` in turn, then collect and write the result."""
    capacity = local_capacity()
    loads = {}
    for world_size in plan.world_sizes:
        loads[world_size] = load_average()
        summary = run_world_size(plan, world_size)
        throughput, step = summary.get("samples_per_second"), summary.get("step_seconds")
        shown = "nothing timed" if throughput is None else f"{throughput:,.1f} samples/s, {step * 1000:,.2f} ms/step"
        echo(f"  world size {world_size}: {shown}")
    result = collect(plan.out, plan.mode, peak_choice, capacity, plan.world_sizes)
    result["commands"] = {str(n): f"nodescale {' '.join(plan.train_argv(n))}" for n in plan.world_sizes}
    for row in result["rows"]:
        row["load_average_before"] = loads[row["world_size"]]
    if str(result["device"]).startswith("cpu"):
        result["notes"].append(cpu_threads_note(capacity[0]))
    busy = [f"{n} ({load:.1f})" for n, load in loads.items() if load is not None and load > capacity[0]]
    if capacity[1] == "CPU cores" and busy:
        # Other processes on the cores distort a CPU benchmark far more than the world size does.
        result["notes"].append(
            f"the machine was busy before world size {', '.join(busy)}: 1-minute load average against "
            f"{capacity[0]} cores; other processes competed for the CPU, so the numbers are noisy"
        )
    write_outputs(plan.out, result)
    return result


TABLE_HEADERS = (
    "processes", "batch / process", "global batch", "samples/s", "speedup (x)", "ideal (x)", "efficiency (%)",
    "step time (ms)", "TFLOP/s", "MFU (%)",
)


def display_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    """The rows of ``result`` as text for :data:`TABLE_HEADERS` (the console table and the report's)."""

    def number(value: float | None, spec: str, unknown: str = "n/a") -> str:
        return unknown if value is None else format(value, spec)

    shown = []
    for row in result["rows"]:
        mark = " *" if row.get("oversubscribed") else ""  # * = more processes than GPUs/cores
        shown.append((
            f"{row['world_size']}{mark}",
            str(row.get("batch_size_per_process")),
            str(row.get("global_batch_size")),
            number(row.get("samples_per_second"), ",.1f"),
            number(row.get("speedup"), ".2f"),
            number(row.get("ideal_speedup"), ".2f"),
            number(None if row.get("efficiency") is None else row["efficiency"] * 100, ".1f"),
            number(row.get("step_ms"), ",.2f"),
            number(row.get("achieved_tflops"), ".3g", "unknown"),
            number(None if row.get("mfu") is None else row["mfu"] * 100, ".2f", "unknown"),
        ))
    return shown
