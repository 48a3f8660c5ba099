"""The node monitor's part of a run's section: CPU, GPU, memory and power next to throughput, on one time axis.

Reads the ``monitor/node-N.csv`` files ``--monitor`` wrote (see
:mod:`nodescale.observe.monitor` for the columns) and the run's step records,
whose ``time`` is the unix time at the end of each logging interval, so
both can be drawn against the same clock. A file cut short by a crash is
read up to its last whole row.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from nodescale.figures import save_png
from nodescale.report import markdown as md

TIME_LABEL = "time since the monitor started (s)"
GB = 1e9  # the plot's memory unit; the table's is md.megabytes' MB (1e6 bytes), as elsewhere in the report


@dataclass
class NodeTrace:
    """One node's monitor file: its numeric columns (None for an empty cell) and how many devices it has."""

    path: Path
    host: str = ""
    node_rank: int | None = None
    columns: dict[str, list[float | None]] = field(default_factory=dict)
    devices: int = 0
    skipped_rows: int = 0  # rows that were cut off or not numbers

    @property
    def label(self) -> str:
        """``node N`` (from the file when it has rows, else from its name)."""
        if self.node_rank is not None:
            return f"node {self.node_rank}"
        return self.path.stem.replace("-", " ")

    def values(self, column: str) -> list[float]:
        """The non-empty values of ``column``."""
        return [value for value in self.columns.get(column, []) if value is not None]

    def series(self, column: str, origin: float, scale: float = 1.0) -> tuple[list[float], list[float]]:
        """``(seconds since origin, value * scale)`` of the rows where ``column`` has a value."""
        pairs = [(t, v) for t, v in zip(self.columns.get("time", []), self.columns.get(column, []), strict=False)
                 if t is not None and v is not None]
        return [t - origin for t, _ in pairs], [v * scale for _, v in pairs]


def read_monitor_csv(path: Path) -> NodeTrace:
    """Read one ``node-N.csv``; rows with a missing or non-numeric time are skipped (and counted)."""
    trace = NodeTrace(path)
    with open(path, newline="", encoding="utf-8", errors="replace") as handle:
        reader = csv.DictReader(handle)
        names = [name for name in (reader.fieldnames or []) if name not in ("host", "node_rank")]
        trace.columns = {name: [] for name in names}
        trace.devices = len({m.group(1) for name in names if (m := re.fullmatch(r"gpu(\d+)_util_percent", name))})
        for row in reader:
            if None in row.values() or None in row or _number(row.get("time")) is None:
                trace.skipped_rows += 1  # short (a crash mid-line) or long: not a row of this file
                continue
            trace.host = trace.host or str(row.get("host", ""))
            rank = _number(row.get("node_rank"))
            if trace.node_rank is None and rank is not None:
                trace.node_rank = int(rank)
            for name in names:
                trace.columns[name].append(_number(row.get(name)))
    return trace


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def _mean_max(values: Sequence[float], digits: int = 1) -> str:
    if not values:
        return md.MISSING
    return f"{md.number(sum(values) / len(values), digits)} / {md.number(max(values), digits)}"


def _device_columns(trace: NodeTrace, field_name: str) -> list[str]:
    return [f"gpu{index}_{field_name}" for index in range(trace.devices)]


def node_energy(trace: NodeTrace) -> float | None:
    """Joules of all the node's devices over the file (each device's last cumulative value); None if one lacks it."""
    if not trace.devices:
        return None
    finals = [trace.values(column) for column in _device_columns(trace, "energy_j")]
    if any(not values for values in finals):
        return None
    return sum(values[-1] for values in finals)


def node_row(trace: NodeTrace, gpus: bool, energy: bool) -> list[str]:
    """The table row of one node: CPU and GPU utilisation (mean / max), peak memory, energy."""
    row = [trace.label, trace.host or md.MISSING, str(len(trace.columns.get("time", []))),
           _mean_max(trace.values("cpu_percent")), _mean_max(trace.values("procs_cpu_percent")),
           md.megabytes(max(trace.values("procs_rss_bytes"), default=None))]
    if gpus:
        util = [v for column in _device_columns(trace, "util_percent") for v in trace.values(column)]
        memory = [v for column in _device_columns(trace, "mem_used_bytes") for v in trace.values(column)]
        row += [_mean_max(util), md.megabytes(max(memory, default=None))]
    if energy:
        row.append(md.number(node_energy(trace), 1))
    return row


def monitor_figure(traces: Sequence[NodeTrace], steps: Sequence[dict[str, Any]], title: str) -> Figure | None:
    """Stacked panels on one time axis: throughput, utilisation, memory and (when reported) power; None if empty."""
    step_points = [(float(r["time"]), float(r["samples_per_second"])) for r in steps
                   if r.get("time") is not None and r.get("samples_per_second") is not None]
    times = [t for trace in traces for t in trace.values("time")] + [t for t, _ in step_points]
    if not any(trace.values("time") for trace in traces):
        return None
    origin = min(times)
    has_power = any(trace.values(column) for trace in traces for column in _device_columns(trace, "power_w"))
    has_gpu = any(trace.devices for trace in traces)
    panels = 4 if has_power else 3
    height = 2.3 * panels + 0.6
    fig = Figure(figsize=(9, height))
    axes = list(fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0])
    fig.subplots_adjust(top=1 - 0.9 / height, hspace=0.35)  # room for the title, not more
    several = len(traces) > 1

    def name(trace: NodeTrace, what: str) -> str:
        return f"{trace.label}: {what}" if several else what

    ax = axes[0]
    if step_points:
        ax.plot([t - origin for t, _ in step_points], [v for _, v in step_points], color="C0", marker=".",
                label="per logging interval (rank 0)")
        ax.legend(fontsize="small", loc="lower right")
    else:
        ax.text(0.5, 0.5, "no step records", transform=ax.transAxes, ha="center", va="center")
    ax.set_ylabel("samples/s")
    ax.set_title("throughput")
    ax.set_ylim(bottom=0)

    ax = axes[1]
    twin = ax.twinx()  # the processes' CPU is in % of one core (can pass 100): its own scale
    colour = 0
    for trace in traces:
        ax.plot(*trace.series("cpu_percent", origin), color=f"C{colour % 10}", label=name(trace, "node CPU"))
        twin.plot(*trace.series("procs_cpu_percent", origin), color=f"C{colour % 10}", linestyle=":",
                  label=name(trace, "training processes CPU (right)"))
        colour += 1
        for column in _device_columns(trace, "util_percent"):
            ax.plot(*trace.series(column, origin), color=f"C{colour % 10}", linestyle="--",
                    label=name(trace, f"{column.split('_')[0]} util"))
            colour += 1
    ax.set_ylabel("node CPU" + (", GPU util" if has_gpu else "") + " (%)")
    ax.set_ylim(0, 105)
    twin.set_ylabel("processes CPU (% of a core)")
    twin.set_ylim(bottom=0)
    _legend(ax, twin)
    ax.set_title("utilisation")

    ax = axes[2]
    colour = 0
    for trace in traces:
        ax.plot(*trace.series("procs_rss_bytes", origin, 1 / GB), color=f"C{colour % 10}",
                label=name(trace, "training processes RSS (host)"))
        colour += 1
        for column in _device_columns(trace, "mem_used_bytes"):
            ax.plot(*trace.series(column, origin, 1 / GB), color=f"C{colour % 10}", linestyle="--",
                    label=name(trace, f"{column.split('_')[0]} memory used"))
            colour += 1
    ax.set_ylabel("memory (GB)")
    ax.set_ylim(bottom=0)
    _legend(ax)
    ax.set_title("memory")

    if has_power:
        ax = axes[3]
        colour = 0
        for trace in traces:
            for column in _device_columns(trace, "power_w"):
                ax.plot(*trace.series(column, origin), color=f"C{colour % 10}",
                        label=name(trace, f"{column.split('_')[0]} power"))
                colour += 1
        ax.set_ylabel("power (W)")
        ax.set_ylim(bottom=0)
        _legend(ax)
        ax.set_title("device power")

    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel(TIME_LABEL)
    fig.suptitle(title)
    return fig


def _legend(ax: Axes, twin: Axes | None = None) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        ax.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.12, 1.0))


def monitor_section(files: Sequence[Path], steps: Sequence[dict[str, Any]], report_dir: Path, name: str,
                    label: str) -> str:
    """Markdown for a run's monitor files: a table per node and the figure, written as ``report_dir/name``.

    ``steps`` are the run's step records (``time`` and ``samples_per_second``).
    """
    traces = sorted((read_monitor_csv(path) for path in files),
                    key=lambda trace: (trace.node_rank is None, trace.node_rank or 0, str(trace.path)))
    gpus = any(trace.devices for trace in traces)
    energy = any(node_energy(trace) is not None for trace in traces)
    headers = ["node", "host", "samples", "CPU mean / max (%)", "training processes CPU mean / max (% of a core)",
               "training processes peak RSS (MB)"]
    if gpus:
        headers += ["GPU util mean / max (%)", "peak GPU memory, one device (MB)"]
    if energy:
        headers.append("GPU energy (J)")
    parts = [
        "### Node monitor",
        f"Sampled by `--monitor` on one process per node ({', '.join(f'`{p.name}`' for p in files)}). "
        f"Node CPU is the whole node's (100% = every core busy); the training processes' CPU is summed over the "
        f"node's ranks (100% = one core). Times are each node's clock; throughput is rank 0's per logging "
        f"interval, warm-up included.",
        md.table(headers, [node_row(trace, gpus, energy) for trace in traces], align_right_from=2),
    ]
    totals = [node_energy(trace) for trace in traces]
    if energy and all(total is not None for total in totals):
        joules = sum(total for total in totals if total is not None)
        parts.append(f"Device energy over the sampled period, all nodes: {md.number(joules, 1)} J "
                     f"({md.number(joules / 3.6e6, 4)} kWh).")
    skipped = sum(trace.skipped_rows for trace in traces)
    if skipped:
        parts.append(f"- note: {skipped} row(s) of the monitor files were incomplete and were skipped")
    fig = monitor_figure(traces, steps, f"{label}: node usage and throughput")
    if fig is None:
        parts.append("_node monitor: nothing to plot (no samples)._")
    else:
        save_png(fig, report_dir / name)
        parts.append(md.image(f"node usage of {label}", name))
    return "\n\n".join(parts)
