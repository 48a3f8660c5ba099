"""The section of a sweep: each member's settings against its results, best first, and a plot per setting."""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any

from nodescale.figures import sweep_figure
from nodescale.launch.sweep_manifest import Member
from nodescale.launch.sweep_state import counts
from nodescale.report import markdown as md
from nodescale.report.run_section import write_figure
from nodescale.report.sources import SweepSource


def ranked(source: SweepSource) -> list[Member]:
    """Finished members by validation loss (lowest first), then finished ones without one, then the rest
    (failed, running, pending) in index order."""
    def key(member: Member) -> tuple[int, float, int]:
        loss = source.summaries.get(member.index, {}).get("val_loss")
        if source.states[member.index] != "done" or member.index not in source.summaries:
            return (2, math.inf, member.index)
        return (0, float(loss), member.index) if loss is not None else (1, math.inf, member.index)
    return sorted(source.sweep.members, key=key)


def setting(value: Any) -> str:
    """A swept value as a table cell: ``0.001`` stays ``0.001``, ``1e-05`` as Python writes it."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def sweep_section(source: SweepSource, report_dir: Path, stem: str) -> str:
    """Markdown for one sweep; writes ``STEM-sweep.png`` (validation loss against each swept setting)."""
    sweep = source.sweep
    rows = []
    for member in ranked(source):
        summary = source.summaries.get(member.index, {})
        name = Path(member.run_dir).name
        rows.append([md.link(name, os.path.relpath(member.run_dir, report_dir)),
                     *(setting(member.settings.get(key)) for key in sweep.keys),
                     md.number(summary.get("val_loss"), 4), md.percent(summary.get("val_accuracy"), 2),
                     md.number(summary.get("samples_per_second"), 1), source.states[member.index]])
    found = ", ".join(f"{count} {state}" for state, count in counts(source.states).items())
    points = [(member.settings, float(source.summaries[member.index]["val_loss"])) for member in ranked(source)
              if source.states[member.index] == "done"
              and source.summaries.get(member.index, {}).get("val_loss") is not None]
    parts = [
        f"## Sweep `{source.label}`",
        f"Directory: {md.directory_link(source.path, report_dir)}. {len(sweep.members)} members ({found}) of "
        f"`{shlex.join(sweep.command)}` over {', '.join(f'`{key}`' for key in sweep.keys)}. Sorted by validation "
        "loss, lowest first; members without a result come last, with their state. Samples/s are each member's "
        "`summary.json`'s: all ranks, warm-up excluded.",
        md.table(["member", *(f"`{key}`" for key in sweep.keys), "val loss", "val accuracy", "samples/s", "state"],
                 rows, align_right_from=1),
    ]
    figure = sweep_figure(sweep.keys, points, "validation loss", f"{source.label}: validation loss")
    parts.append("_No member has finished with a validation loss yet: nothing to plot._" if figure is None else
                 write_figure(figure, report_dir, f"{stem}-sweep.png",
                              f"validation loss against each setting of {source.label}"))
    return "\n\n".join(parts)
