"""Assemble ``report.md``: recognise every directory, then one section each (and a comparison of runs)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

from nodescale import __version__
from nodescale.atomic_files import write_text_atomic
from nodescale.report.comm_section import comm_section
from nodescale.report.compare_section import compare_section
from nodescale.report.plan_section import plan_section
from nodescale.report.run_section import run_section
from nodescale.report.scaling_section import scaling_section
from nodescale.report.sources import CommSource, RunSource, ScalingSource, Source, SweepSource, load_source
from nodescale.report.sweep_section import sweep_section

REPORT_NAME = "report.md"
KIND_NAMES = {"run": "training run", "scaling": "bench scaling", "comm": "bench comm", "sweep": "sweep"}


def default_report_dir(dirs: Sequence[Path]) -> Path:
    """One directory: the directory itself. Several: ``report-<YYYYmmdd-HHMMSS>`` in the current directory."""
    if len(dirs) == 1:
        return dirs[0]
    return Path(f"report-{time.strftime('%Y%m%d-%H%M%S')}")


def assign_labels(sources: Sequence[Source]) -> None:
    """Name each source by its directory's name; names shared by several get their parent, then a number."""
    names = [source.path.name or str(source.path) for source in sources]
    for index, source in enumerate(sources):
        name = names[index]
        if names.count(name) > 1:
            name = f"{source.path.parent.name}/{name}" if source.path.parent.name else name
        source.label = name
    seen: dict[str, int] = {}
    for source in sources:
        seen[source.label] = seen.get(source.label, 0) + 1
        if seen[source.label] > 1:
            source.label = f"{source.label} ({seen[source.label]})"


def file_stem(label: str, taken: set[str]) -> str:
    """``report-<label>`` with characters unsafe in file names replaced, unique among ``taken``."""
    base = "report-" + (re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "dir")
    stem, number = base, 2
    while stem in taken:
        stem, number = f"{base}-{number}", number + 1
    taken.add(stem)
    return stem


def build_report(dirs: Sequence[Path], out: Path | None = None) -> Path:
    """Write ``report.md`` and its PNGs for ``dirs`` into ``out`` (default: :func:`default_report_dir`).

    Every directory is recognised and read before anything is written, so a
    wrong one costs nothing. Returns the path of ``report.md``.
    """
    unique: dict[Path, Path] = {}
    for directory in dirs:
        unique.setdefault(directory.resolve(), directory)  # the same directory twice is reported once
    sources = [load_source(directory) for directory in unique.values()]
    report_dir = out if out is not None else default_report_dir(list(unique.values()))
    report_dir.mkdir(parents=True, exist_ok=True)
    assign_labels(sources)
    runs = [source for source in sources if isinstance(source, RunSource)]
    taken = {"report-compare"}
    parts = [
        "# nodescale report",
        f"Made {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by nodescale {__version__} from:",
        "\n".join(f"- `{source.label}`: {KIND_NAMES[source.kind]}, `{os.path.relpath(source.path, report_dir)}`"
                  for source in sources),
    ]
    if len(runs) > 1:
        parts.append(compare_section(runs, report_dir))
    for source in sources:
        stem = file_stem(source.label, taken)
        if isinstance(source, RunSource):
            parts += [run_section(source, report_dir, stem), plan_section(source)]
        elif isinstance(source, ScalingSource):
            parts.append(scaling_section(source, report_dir, stem))
        elif isinstance(source, CommSource):
            parts.append(comm_section(source, report_dir, stem))
        elif isinstance(source, SweepSource):
            parts.append(sweep_section(source, report_dir, stem))
    path = report_dir / REPORT_NAME
    write_text_atomic(path, "\n\n".join(parts) + "\n")
    return path
