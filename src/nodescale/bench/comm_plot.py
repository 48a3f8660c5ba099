"""``busbw.png``: bus bandwidth against message size, one line per operation.

Drawn on a bare :class:`matplotlib.figure.Figure` with the Agg canvas: no pyplot, no global
state, no display needed on a compute node. Out-of-place results are solid lines, in-place
results dotted lines of the same colour.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from nodescale.atomic_files import write_atomic
from nodescale.bench.comm_math import OPS, format_size

X_LABEL = "message size (bytes)"
Y_LABEL = "bus bandwidth (GB/s, 1e9 B/s)"


def busbw_figure(rows: Sequence[dict[str, Any]], title: str) -> Figure:
    """The figure of ``rows`` (results.json rows): busbw (GB/s) over size (bytes, log2 axis)."""
    figure = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colours = {op: f"C{index}" for index, op in enumerate(OPS)}
    for op in [op for op in OPS if any(row["op"] == op for row in rows)]:
        for in_place, style in ((False, "-"), (True, ":")):
            points = sorted((row["bytes"], row["busbw_GBps"]) for row in rows
                            if row["op"] == op and row["in_place"] == in_place)
            if points:
                axes.plot([x for x, _ in points], [y for _, y in points], style, marker="o", markersize=3,
                          color=colours[op], label=f"{op} (in-place)" if in_place else op)
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: format_size(int(value)) if value >= 1 else ""))
    axes.set_xlabel(X_LABEL)
    axes.set_ylabel(Y_LABEL)
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.grid(True, which="major", alpha=0.3)
    if rows:
        axes.legend(fontsize="small", ncols=2)
    return figure


def write_busbw_plot(path: Path, rows: Sequence[dict[str, Any]], title: str) -> Path:
    """Draw :func:`busbw_figure` into ``path`` (PNG), atomically."""
    figure = busbw_figure(rows, title)
    write_atomic(path, lambda handle: figure.savefig(handle, format="png", dpi=120))
    return path
