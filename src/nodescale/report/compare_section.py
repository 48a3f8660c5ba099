"""The side-by-side comparison of several runs: one table column per run, overlaid curves."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nodescale.figures import curves_figure, throughput_figure
from nodescale.report import markdown as md
from nodescale.report.run_section import summary_rows, write_figure
from nodescale.report.sources import RunSource


def compare_section(runs: Sequence[RunSource], report_dir: Path, stem: str = "report-compare") -> str:
    """Markdown comparing ``runs``; writes ``STEM-curves.png`` and ``STEM-throughput.png``."""
    rows = summary_rows([run.summary for run in runs])
    base = runs[0].summary.get("samples_per_second")
    relative = [md.MISSING if not base or run.summary.get("samples_per_second") is None
                else f"{run.summary['samples_per_second'] / base:.2f}" for run in runs]
    rows.append((f"throughput relative to `{runs[0].label}` (x)", *relative))
    parts = [
        f"## Comparison of {len(runs)} runs",
        md.table(["", *(f"`{run.label}`" for run in runs)], rows),
        write_figure(curves_figure(runs, "loss and accuracy"), report_dir, f"{stem}-curves.png",
                     "loss and accuracy of every run"),
        write_figure(throughput_figure(runs, "throughput"), report_dir, f"{stem}-throughput.png",
                     "throughput of every run"),
    ]
    return "\n\n".join(parts)
