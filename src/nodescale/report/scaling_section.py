"""The section of a ``nodescale bench scaling`` directory: its table, notes and plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nodescale.bench.scaling_results import display_table
from nodescale.figures import scaling_figure
from nodescale.report import markdown as md
from nodescale.report.monitor_section import node_energy, read_monitor_csv
from nodescale.report.run_section import write_figure
from nodescale.report.sources import ScalingSource


def scaling_section(scaling: ScalingSource, report_dir: Path, stem: str) -> str:
    """Markdown for one bench scaling directory; writes ``STEM-scaling.png`` (regenerated from scaling.json)."""
    result = scaling.result
    settings = result.get("settings", {})
    headers, rows = display_table(result)
    energies = [energy_per_sample(scaling.path / str(row.get("run_dir", ""))) for row in result["rows"]]
    if any(energy is not None for energy in energies):  # only where --monitor measured the GPUs' energy
        headers.append("GPU energy / sample (J)")
        rows = [[*row, md.number(energy, 4) if energy is not None else "n/a"]
                for row, energy in zip(rows, energies, strict=True)]
    kept = "global batch fixed" if result.get("mode") == "strong" else "batch per process fixed"
    parts = [f"## bench scaling `{scaling.label}`"]
    study = result.get("study")
    if study:
        jobs = "; ".join(f"{job['nodes']} node(s): {job['state']} (job {job['job_id']})" for job in study["jobs"])
        parts.append(f"A study across node counts, one {study['scheduler']} job per count: {jobs}.")
        if not result["rows"]:
            return "\n\n".join([*parts, "No size has finished yet."])
    parts += [
        f"Directory: {md.directory_link(scaling.path, report_dir)}. "
        f"{str(result.get('mode', '?')).capitalize()} scaling ({kept}) of {settings.get('model')} on "
        f"{settings.get('dataset')} with {settings.get('strategy')}, {settings.get('precision')}, on "
        f"{result.get('device')}. Speedup and efficiency are relative to "
        f"world size {result.get('base_world_size')}; samples/s are all processes together, warm-up excluded.",
        # `*` marks oversubscribed rows; escaped so markdown does not read it as emphasis.
        md.table(headers, [[c.replace("*", "\\*") for c in row] for row in rows]),
    ]
    if any(row.get("oversubscribed") for row in result["rows"]):
        parts.append("\\* more processes than the machine's GPUs or cores.")
    if any(energy is not None for energy in energies):
        parts.append("GPU energy per sample: the monitor's device energy over the whole run, all nodes, warm-up "
                     "included, over the samples trained (optimiser steps x global batch).")
    peak = result.get("peak")
    if peak:
        parts.append(f"MFU against {peak['tflops']} TFLOP/s ({peak['dtype']}) per device: {peak['source']}.")
    if result.get("notes"):
        parts.append("\n".join(f"- note: {note}" for note in result["notes"]))
    parts.append(write_figure(scaling_figure(result) if result["rows"] else None, report_dir, f"{stem}-scaling.png",
                              f"scaling of {scaling.label}"))
    return "\n\n".join(parts)


def energy_per_sample(run_dir: Path) -> float | None:
    """Joules of all the run's GPUs per sample trained, from its ``monitor/node-N.csv``; None if not measured."""
    files = sorted((run_dir / "monitor").glob("node-*.csv"))
    totals = [node_energy(read_monitor_csv(path)) for path in files]
    if not totals or any(total is None for total in totals):
        return None
    try:
        summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        samples = int(summary["global_steps"]) * int(summary["global_batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return sum(total for total in totals if total is not None) / samples if samples else None
