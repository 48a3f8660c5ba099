"""Every figure nodescale draws (bench scaling, bench comm, a run's curves) and the one way they are saved.

``nodescale bench`` writes them beside its results and ``nodescale report`` draws them
again from the same files, so both call these functions. Figures are made with
``matplotlib.figure.Figure`` directly (no pyplot): no GUI backend is touched, nothing
global is left behind and PNG output goes through the Agg renderer. Every axis is
labelled with its unit; one colour per run (or per collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from nodescale.atomic_files import write_atomic

PROCESSES_LABEL = "processes (world size)"
THROUGHPUT_LABEL = "throughput (samples/s)"
EFFICIENCY_LABEL = "efficiency (%)"
STEP_LABEL = "optimiser step"
LOSS_LABEL = "loss"
ACCURACY_LABEL = "accuracy (%)"
SIZE_LABEL = "message size (bytes)"
BUSBW_LABEL = "bus bandwidth (GB/s, 1e9 B/s)"


class Run(Protocol):
    """What a run's figures read (``report.sources.RunSource``): its name, summary.json and metric records."""

    label: str
    summary: dict[str, Any]

    def records(self, kind: str) -> list[dict[str, Any]]:
        """The metrics.jsonl records of one kind (``step``, ``epoch``)."""


def save_png(fig: Figure, path: Path, dpi: int = 110) -> None:
    """Write ``fig`` to ``path`` as a PNG, atomically (a reader never sees half an image)."""
    write_atomic(path, lambda handle: fig.savefig(handle, format="png", dpi=dpi, bbox_inches="tight"))


def _colour(index: int) -> str:
    return f"C{index % 10}"


def _step_axis(ax: Axes) -> None:
    ax.set_xlabel(STEP_LABEL)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers


def world_size_axis(ax: Axes, world_sizes: Sequence[int], nodes: Sequence[int] | None = None) -> None:
    """Processes on a log2 axis with a tick at each measured world size (1, 2, 4... evenly spaced); with
    ``nodes`` (a study across node counts), each tick says its nodes too."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(list(world_sizes)))
    ax.xaxis.set_minor_locator(NullLocator())
    if nodes:
        ax.set_xticklabels([f"{n}\n{k} node{'' if k == 1 else 's'}" for n, k in zip(world_sizes, nodes, strict=True)])
    else:
        ax.set_xticklabels([str(n) for n in world_sizes])
    ax.set_xlabel(PROCESSES_LABEL)
    if len(world_sizes) == 1:  # a log axis around one point needs explicit limits
        ax.set_xlim(world_sizes[0] / 1.5, world_sizes[0] * 1.5)


def scaling_figure(result: dict[str, Any]) -> Figure:
    """The figure of ``scaling.json``'s content: throughput (with ideal) and efficiency (with 100%).

    The ideal throughput line is the base's throughput times ``N / base``;
    points without a measurement are left out.
    """
    rows = [row for row in result["rows"] if row.get("samples_per_second") is not None]
    sizes = [row["world_size"] for row in result["rows"]]
    nodes = [row["nodes"] for row in result["rows"]] if all("nodes" in row for row in result["rows"]) else None
    fig = Figure(figsize=(10, 4.2))
    left, right = fig.subplots(1, 2)
    settings = result.get("settings", {})
    fig.suptitle(
        f"{result.get('mode', '?')} scaling: {settings.get('model', '?')} on {settings.get('dataset', '?')}, "
        f"{settings.get('strategy', '?')}, {_device_label(result)}"
    )

    measured_n = [row["world_size"] for row in rows]
    if rows:
        base = rows[0]
        ideal = [base["samples_per_second"] * n / base["world_size"] for n in sizes]
        left.plot(sizes, ideal, linestyle="--", color="grey", label="ideal (linear)")
        left.plot(measured_n, [row["samples_per_second"] for row in rows], marker="o", label="measured")
    left.set_ylabel(THROUGHPUT_LABEL)
    left.set_title("throughput, all processes")
    left.set_ylim(bottom=0)
    world_size_axis(left, sizes, nodes)
    left.grid(True, alpha=0.3)
    left.legend()

    efficient = [row for row in rows if row.get("efficiency") is not None]
    right.axhline(100.0, linestyle="--", color="grey", label="ideal (100%)")
    right.plot([row["world_size"] for row in efficient], [row["efficiency"] * 100 for row in efficient],
               marker="o", color="tab:orange", label="measured")
    right.set_ylabel(EFFICIENCY_LABEL)
    base_n = sizes[0] if sizes else 1
    right.set_title(f"efficiency relative to {base_n} process{'' if base_n == 1 else 'es'}")
    top = max([110.0, *(row["efficiency"] * 100 * 1.1 for row in efficient)])
    right.set_ylim(0, top)
    world_size_axis(right, sizes, nodes)
    right.grid(True, alpha=0.3)
    right.legend()
    return fig


def _device_label(result: dict[str, Any]) -> str:
    device = result.get("device") or "unknown device"
    return device if len(device) <= 40 else device[:37] + "..."


def validation_points(run: Run, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of each evaluation: the epoch records, plus the final one if it came mid-epoch."""
    points = [(int(r["step"]), float(r[key])) for r in run.records("epoch") if r.get(key) is not None]
    final = run.summary.get(key)
    steps = run.summary.get("global_steps")
    if final is not None and steps is not None and all(step != steps for step, _ in points):
        points.append((int(steps), float(final)))
    return points


def _series(run: Run, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    records = [r for r in run.records("step") if r.get(key) is not None and r.get("step") is not None]
    return [int(r["step"]) for r in records], [float(r[key]) * scale for r in records]


def _curve(ax: Axes, runs: Sequence[Run], key: str, scale: float, labelled: bool) -> bool:
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


def curves_figure(runs: Sequence[Run], title: str) -> Figure | None:
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


def throughput_figure(runs: Sequence[Run], title: str) -> Figure | None:
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


def busbw_figure(rows: Sequence[dict[str, Any]], title: str) -> Figure | None:
    """Bus bandwidth over message size (log2 axis) of results.json ``rows``, one colour per collective.

    Out-of-place results are solid lines, in-place ones dotted in the same colour; the dtype
    joins the name where the rows hold several. ``None`` when no row has a bandwidth.
    """
    rows = [row for row in rows if row.get("bytes") and row.get("busbw_GBps") is not None]
    if not rows:
        return None
    several_dtypes = len({str(row.get("dtype")) for row in rows}) > 1
    series: dict[tuple[str, bool], list[tuple[int, float]]] = {}  # in the rows' order: the sweep's op order
    for row in rows:
        name = f"{row['op']} {row.get('dtype')}" if several_dtypes else str(row["op"])
        series.setdefault((name, bool(row.get("in_place"))), []).append((int(row["bytes"]), float(row["busbw_GBps"])))
    colours = {name: _colour(index) for index, name in enumerate(dict.fromkeys(name for name, _ in series))}
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax = fig.add_subplot()
    for (name, in_place), points in series.items():
        points.sort()
        ax.plot([x for x, _ in points], [y for _, y in points], ":" if in_place else "-", marker="o", markersize=3,
                color=colours[name], label=f"{name} (in-place)" if in_place else name)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _size_label(int(value)) if value >= 1 else ""))
    ax.set_xlabel(SIZE_LABEL)
    ax.set_ylabel(BUSBW_LABEL)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small", ncols=2)
    return fig


def _size_label(size_bytes: int) -> str:
    """``1024`` -> ``"1K"``, ``3 * 1024**2`` -> ``"3M"``; bytes that are no whole unit stay bytes."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale}{unit}"
    return str(size_bytes)


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def sweep_figure(keys: Sequence[str], points: Sequence[tuple[dict[str, Any], float]], metric_label: str,
                 title: str) -> Figure | None:
    """A metric of a sweep's members (``points``: settings, value) against each swept setting, one panel per key.

    Numbers spanning more than 10x (learning rates) get a log axis; other settings are categories in
    the order first seen. ``None`` when no member has the metric.
    """
    if not points or not keys:
        return None
    fig = Figure(figsize=(0.8 + 4.2 * len(keys), 4.0), layout="constrained")
    for ax, key in zip(fig.subplots(1, len(keys), squeeze=False)[0], keys, strict=True):
        numbers = [_as_number(settings.get(key)) for settings, _ in points]
        if all(number is not None for number in numbers):
            xs: list[float] = [number for number in numbers if number is not None]
            if min(xs) > 0 and max(xs) > 10 * min(xs):
                ax.set_xscale("log")
        else:
            categories = list(dict.fromkeys(str(settings.get(key)) for settings, _ in points))
            xs = [float(categories.index(str(settings.get(key)))) for settings, _ in points]
            ax.set_xticks(range(len(categories)), categories)
        ax.plot(xs, [value for _, value in points], "o", color=_colour(0))
        ax.set_xlabel(key)
        ax.set_ylabel(metric_label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    return fig
