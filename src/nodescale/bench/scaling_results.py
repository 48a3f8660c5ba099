"""Turn the runs of a scaling study into its result: read, tabulate and write them.

Everything reported is read back from the runs' ``summary.json`` files
(``OUT/ws-N``), so runs made by ``nodescale bench scaling`` and runs made
elsewhere (one cluster job per world size) are analysed the same way
(:func:`collect`).

Outputs: ``OUT/scaling.json`` (settings, per-world-size rows, notes),
``OUT/scaling.csv`` (the rows) and ``OUT/scaling.png`` (the plot); and the
rows as text for a table (:func:`display_table`).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nodescale.atomic_files import write_json_atomic, write_text_atomic
from nodescale.bench import peaks, scaling_math
from nodescale.bench.scaling_math import Measurement, Mode
from nodescale.errors import UserError

# The run directory of world size N is OUT/ws-N (the runner in nodescale.bench.scaling names them so); a study
# across node counts (nodescale.bench.scaling_study) names its runs OUT/nodes-N.
RUN_PREFIX, NODES_PREFIX = "ws-", "nodes-"
CSV_COLUMNS = (
    "world_size", "devices", "batch_size_per_process", "global_batch_size", "samples_per_second",
    "samples_per_second_per_device", "tokens_per_second", "speedup", "ideal_speedup", "efficiency", "step_ms",
    "timed_steps", "achieved_tflops", "mfu", "oversubscribed", "run_dir",
)
UNITS = {
    "samples_per_second": "samples/s, all processes, warm-up excluded",
    "tokens_per_second": "tokens/s, all processes, warm-up excluded (language models; null otherwise)",
    "step_ms": "milliseconds per optimiser step, slowest rank",
    "speedup": "throughput / throughput of the base world size",
    "efficiency": "speedup / (world_size / base world size), 1.0 = ideal",
    "achieved_tflops": "1e12 FLOP/s, 3 x forward FLOPs per sample x samples/s",
    "mfu": "achieved FLOP/s / (peak FLOP/s per device x devices), 0..1; null = unknown",
}


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
    """The finished runs in ``out`` (``ws-*/summary.json``, ``nodes-*/...``), by the world size their summary states."""
    runs: dict[int, Path] = {}
    for run_dir in sorted(path for prefix in (RUN_PREFIX, NODES_PREFIX) for path in out.glob(f"{prefix}*")):
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
            "tokens_per_second": summary.get("tokens_per_second"),
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
    from nodescale.figures import save_png, scaling_figure

    paths = [out / "scaling.json", out / "scaling.csv", out / "scaling.png"]
    write_json_atomic(paths[0], result)
    write_text_atomic(paths[1], rows_csv(result))
    save_png(scaling_figure(result), paths[2])
    return paths


TABLE_HEADERS = (
    "processes", "batch / process", "global batch", "samples/s", "tokens/s", "speedup (x)", "ideal (x)",
    "efficiency (%)", "step time (ms)", "TFLOP/s", "MFU (%)",
)


def display_table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of ``result`` as text (the console table and the report's); the tokens/s column
    only for language models."""

    def number(value: float | None, spec: str, unknown: str = "n/a") -> str:
        return unknown if value is None else format(value, spec)

    tokens = any(row.get("tokens_per_second") is not None for row in result["rows"])
    nodes = any("nodes" in row for row in result["rows"])  # a study across node counts
    shown = []
    for row in result["rows"]:
        mark = " *" if row.get("oversubscribed") else ""  # * = more processes than GPUs/cores
        shown.append([
            *([str(row.get("nodes"))] if nodes else []),
            f"{row['world_size']}{mark}",
            str(row.get("batch_size_per_process")),
            str(row.get("global_batch_size")),
            number(row.get("samples_per_second"), ",.1f"),
            *([number(row.get("tokens_per_second"), ",.0f")] if tokens else []),
            number(row.get("speedup"), ".2f"),
            number(row.get("ideal_speedup"), ".2f"),
            number(None if row.get("efficiency") is None else row["efficiency"] * 100, ".1f"),
            number(row.get("step_ms"), ",.2f"),
            number(row.get("achieved_tflops"), ".3g", "unknown"),
            number(None if row.get("mfu") is None else row["mfu"] * 100, ".2f", "unknown"),
        ])
    headers = [header for header in TABLE_HEADERS if tokens or header != "tokens/s"]
    return (["nodes"] if nodes else []) + headers, shown
