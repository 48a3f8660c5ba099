"""The section of one training run: its timing and stats table, curves and throughput plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from nodescale.figures import curves_figure, save_png, throughput_figure
from nodescale.report import markdown as md
from nodescale.report.monitor_section import monitor_section
from nodescale.report.sources import RunSource


def _state_mb(summary: dict[str, Any]) -> str:
    state = summary.get("state_bytes_per_rank")
    return md.megabytes(state.get("total_bytes"), 3) if isinstance(state, dict) else md.MISSING


def _peak_memory(summary: dict[str, Any]) -> str:
    shown = md.megabytes(summary.get("peak_memory_bytes"))
    kind = summary.get("peak_memory_kind")
    return f"{shown} ({kind})" if kind and shown != md.MISSING else shown


def _steps(summary: dict[str, Any]) -> str:
    return f"{summary.get('global_steps', md.MISSING)} ({summary.get('timed_steps', md.MISSING)} timed)"


def _text(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda summary: md.MISSING if summary.get(key) is None else str(summary[key])


# (row label, how to show it): the same rows in a run's table and in the comparison.
# Number formats match the console's summary table, so figures can be found in both.
SUMMARY_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("processes (world size)", _text("world_size")),
    ("strategy", _text("strategy")),
    ("model", _text("model")),
    ("dataset", _text("dataset")),
    ("precision", _text("precision")),
    ("device", _text("device")),
    ("batch per process / global", lambda s: f"{s.get('batch_size_per_process')} / {s.get('global_batch_size')}"),
    ("optimiser steps", _steps),
    ("throughput, all ranks (samples/s)", lambda s: md.number(s.get("samples_per_second"), 1)),
    ("throughput per device (samples/s)", lambda s: md.number(s.get("samples_per_second_per_device"), 1)),
    ("throughput, all ranks (tokens/s)", lambda s: md.number(s.get("tokens_per_second"), 1)),
    ("throughput per device (tokens/s)", lambda s: md.number(s.get("tokens_per_second_per_device"), 1)),
    ("model FLOPs utilisation (MFU)", lambda s: md.percent(s.get("mfu"), 1)),
    ("average step time (ms)", lambda s: md.milliseconds(s.get("step_seconds"))),
    ("data wait (share of step time)", lambda s: md.percent(s.get("data_wait_fraction"), 1)),
    ("average epoch time (s)", lambda s: md.number(s.get("average_epoch_seconds"), 3)),
    ("validation loss", lambda s: md.number(s.get("val_loss"), 4)),
    ("validation accuracy", lambda s: md.percent(s.get("val_accuracy"), 2)),
    ("validation perplexity", lambda s: md.number(s.get("val_perplexity"), 3)),
    ("wall time (s)", lambda s: md.number(s.get("wall_seconds"), 2)),
    ("peak memory (MB)", _peak_memory),
    ("training state, largest rank (MB)", _state_mb),
)


def summary_rows(summaries: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """:data:`SUMMARY_ROWS` for these runs' summaries, one column each; rows no run has (a classifier's
    tokens/s, MFU on a CPU) are left out."""
    rows = [(label, *(show(summary) for summary in summaries)) for label, show in SUMMARY_ROWS]
    return [row for row in rows if any(value != md.MISSING for value in row[1:])]


def write_figure(fig: Figure | None, report_dir: Path, name: str, alt: str) -> str:
    """Save ``fig`` as ``report_dir/name`` and return its markdown image, or a note when there was nothing to plot."""
    if fig is None:
        return f"_{alt}: nothing to plot (no step records)._"
    save_png(fig, report_dir / name)
    return md.image(alt, name)


def run_notes(run: RunSource) -> list[str]:
    """Caveats a reader of this run's figures needs."""
    notes = []
    if run.summary.get("timing_includes_warmup"):
        notes.append("the run was too short to exclude warm-up: its throughput includes start-up steps")
    if run.skipped_lines:
        notes.append(f"{run.skipped_lines} line(s) of metrics.jsonl were not JSON and were skipped")
    return notes


def run_section(run: RunSource, report_dir: Path, stem: str) -> str:
    """Markdown for one run; writes ``STEM-curves.png``, ``STEM-throughput.png`` (and ``STEM-monitor.png``)."""
    parts = [
        f"## Run `{run.label}`",
        f"Directory: {md.directory_link(run.path, report_dir)}. Throughput and step time are `summary.json`'s: "
        "real samples of all ranks over the slowest rank's time, warm-up excluded.",
        md.table(["", "value"], summary_rows([run.summary])),
    ]
    if run_notes(run):
        parts.append("\n".join(f"- note: {note}" for note in run_notes(run)))
    parts.append(write_figure(curves_figure([run], f"{run.label}: loss and accuracy"), report_dir,
                              f"{stem}-curves.png", f"loss and accuracy of {run.label}"))
    parts.append(write_figure(throughput_figure([run], f"{run.label}: throughput"), report_dir,
                              f"{stem}-throughput.png", f"throughput of {run.label}"))
    if run.monitor_files:  # a --monitor run: its nodes' usage against the same clock as its throughput
        parts.append(monitor_section(run.monitor_files, run.records("step"), report_dir, f"{stem}-monitor.png",
                                     run.label))
    return "\n\n".join(parts)
