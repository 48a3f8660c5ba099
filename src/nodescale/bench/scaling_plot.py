"""The scaling plot: throughput and efficiency against processes, each with its ideal line.

Figures are made with ``matplotlib.figure.Figure`` directly (no pyplot), so
no GUI backend is touched and nothing global is left behind; PNG output goes
through the Agg renderer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator

from nodescale.atomic_files import write_atomic

PROCESSES_LABEL = "processes (world size)"
THROUGHPUT_LABEL = "throughput (samples/s)"
EFFICIENCY_LABEL = "efficiency (%)"


def save_png(fig: Figure, path: Path, dpi: int = 110) -> None:
    """Write ``fig`` to ``path`` as a PNG, atomically (a reader never sees half an image)."""
    write_atomic(path, lambda handle: fig.savefig(handle, format="png", dpi=dpi, bbox_inches="tight"))


def world_size_axis(ax: Axes, world_sizes: Sequence[int]) -> None:
    """Processes on a log2 axis with a tick at each measured world size (1, 2, 4... evenly spaced)."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(list(world_sizes)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(n) for n in world_sizes])
    ax.set_xlabel(PROCESSES_LABEL)
    if len(world_sizes) == 1:  # a log axis around one point needs explicit limits
        ax.set_xlim(world_sizes[0] / 1.5, world_sizes[0] * 1.5)


def plot_scaling(result: dict[str, Any]) -> Figure:
    """The figure of ``scaling.json``'s content: throughput (with ideal) and efficiency (with 100%).

    The ideal throughput line is the base's throughput times ``N / base``;
    points without a measurement are left out.
    """
    rows = [row for row in result["rows"] if row.get("samples_per_second") is not None]
    sizes = [row["world_size"] for row in result["rows"]]
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
    world_size_axis(left, sizes)
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
    world_size_axis(right, sizes)
    right.grid(True, alpha=0.3)
    right.legend()
    return fig


def _device_label(result: dict[str, Any]) -> str:
    device = result.get("device") or "unknown device"
    return device if len(device) <= 40 else device[:37] + "..."
