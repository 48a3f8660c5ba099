"""The report's figures, each returned as a ``matplotlib.figure.Figure`` (saved by the caller).

Every axis is labelled with its unit. Curves of one run and overlays of
several runs come from the same functions: one colour per run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from nodescale.report.sources import CommSource, RunSource

STEP_LABEL = "optimiser step"
LOSS_LABEL = "loss"
ACCURACY_LABEL = "accuracy (%)"
THROUGHPUT_LABEL = "throughput (samples/s)"
SIZE_LABEL = "message size (bytes)"
BUSBW_LABEL = "bus bandwidth (GB/s)"


def _step_axis(ax: Axes) -> None:
    ax.set_xlabel(STEP_LABEL)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers


def _colour(index: int) -> str:
    return f"C{index % 10}"


def validation_points(run: RunSource, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of each evaluation: the epoch records, plus the final one if it came mid-epoch."""
    points = [(int(r["step"]), float(r[key])) for r in run.records("epoch") if r.get(key) is not None]
    final = run.summary.get(key)
    steps = run.summary.get("global_steps")
    if final is not None and steps is not None and all(step != steps for step, _ in points):
        points.append((int(steps), float(final)))
    return points


def _series(run: RunSource, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    records = [r for r in run.records("step") if r.get(key) is not None and r.get("step") is not None]
    return [int(r["step"]) for r in records], [float(r[key]) * scale for r in records]


def _curve(ax: Axes, runs: Sequence[RunSource], key: str, scale: float, labelled: bool) -> bool:
    drawn = False
    for index, run in enumerate(runs):
        prefix = f"{run.label} " if labelled else ""
        steps, values = _series(run, key, scale)
        if steps:
            ax.plot(steps, values, color=_colour(index), marker="." if len(steps) < 30 else None,
                    label=f"{prefix}training")
            drawn = True
        points = validation_points(run, f"val_{key}")
        if points:
            ax.plot([p[0] for p in points], [p[1] * scale for p in points], color=_colour(index), marker="o",
                    linestyle=":", label=f"{prefix}validation")
            drawn = True
    return drawn


def curves_figure(runs: Sequence[RunSource], title: str) -> Figure | None:
    """Loss and accuracy against the step for one or several runs (training solid, validation dotted).

    The accuracy panel is left out when no run has accuracies (regression);
    ``None`` when there is nothing at all to draw.
    """
    has_accuracy = any(_series(run, "accuracy")[0] or validation_points(run, "val_accuracy") for run in runs)
    fig = Figure(figsize=(10 if has_accuracy else 5.5, 4.2))
    axes = fig.subplots(1, 2 if has_accuracy else 1, squeeze=False)[0]
    labelled = len(runs) > 1
    drawn = _curve(axes[0], runs, "loss", 1.0, labelled)
    axes[0].set_ylabel(LOSS_LABEL)
    axes[0].set_title("loss (mean per sample)")
    if has_accuracy:
        _curve(axes[1], runs, "accuracy", 100.0, labelled)
        axes[1].set_ylabel(ACCURACY_LABEL)
        axes[1].set_title("accuracy")
    if not drawn:
        return None
    for ax in axes:
        _step_axis(ax)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return fig


def throughput_figure(runs: Sequence[RunSource], title: str) -> Figure | None:
    """Samples/s of each logging interval against the step, with each run's summary figure dashed.

    The interval figures include warm-up and are rank 0's clock; the dashed
    line is ``summary.json``'s (warm-up excluded, slowest rank), the one to quote.
    """
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    drawn = False
    labelled = len(runs) > 1
    for index, run in enumerate(runs):
        prefix = f"{run.label}: " if labelled else ""
        steps, values = _series(run, "samples_per_second")
        if steps:
            ax.plot(steps, values, color=_colour(index), marker="." if len(steps) < 30 else None,
                    label=f"{prefix}per logging interval")
            drawn = True
        overall = run.summary.get("samples_per_second")
        if overall is not None:
            ax.axhline(overall, color=_colour(index), linestyle="--",
                       label=f"{prefix}run summary, warm-up excluded ({overall:,.0f})")
            drawn = True
    if not drawn:
        return None
    _step_axis(ax)
    ax.set_ylabel(THROUGHPUT_LABEL)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title)
    return fig


def comm_series_key(row: dict[str, Any], varying: Sequence[str]) -> str:
    """The legend name of a bench comm row: its op, plus whichever of dtype/in_place vary in the file."""
    parts = [str(row.get("op"))]
    if "dtype" in varying:
        parts.append(str(row.get("dtype")))
    if "in_place" in varying:
        parts.append("in place" if row.get("in_place") else "out of place")
    return " ".join(parts)


def varying_fields(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Which of ``dtype`` and ``in_place`` take more than one value among ``rows``."""
    return [key for key in ("dtype", "in_place") if len({str(row.get(key)) for row in rows}) > 1]


def busbw_figure(comm: CommSource, title: str) -> Figure | None:
    """Bus bandwidth against message size, one line per collective (log2 size axis)."""
    rows = [r for r in comm.rows if r.get("bytes") and r.get("busbw_GBps") is not None]
    if not rows:
        return None
    varying = varying_fields(rows)
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        series.setdefault(comm_series_key(row, varying), []).append((int(row["bytes"]), float(row["busbw_GBps"])))
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for index, (name, points) in enumerate(sorted(series.items())):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=_colour(index), label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(SIZE_LABEL)
    ax.set_ylabel(BUSBW_LABEL)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title)
    return fig
