"""The section of a ``nodescale bench scaling`` directory: its table, notes and plot."""

from __future__ import annotations

from pathlib import Path

from nodescale.bench.scaling_results import display_table
from nodescale.figures import scaling_figure
from nodescale.report import markdown as md
from nodescale.report.run_section import write_figure
from nodescale.report.sources import ScalingSource


def scaling_section(scaling: ScalingSource, report_dir: Path, stem: str) -> str:
    """Markdown for one bench scaling directory; writes ``STEM-scaling.png`` (regenerated from scaling.json)."""
    result = scaling.result
    settings = result.get("settings", {})
    headers, rows = display_table(result)
    kept = "global batch fixed" if result.get("mode") == "strong" else "batch per process fixed"
    parts = [
        f"## bench scaling `{scaling.label}`",
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
    peak = result.get("peak")
    if peak:
        parts.append(f"MFU against {peak['tflops']} TFLOP/s ({peak['dtype']}) per device: {peak['source']}.")
    if result.get("notes"):
        parts.append("\n".join(f"- note: {note}" for note in result["notes"]))
    parts.append(write_figure(scaling_figure(result) if result["rows"] else None, report_dir, f"{stem}-scaling.png",
                              f"scaling of {scaling.label}"))
    return "\n\n".join(parts)
