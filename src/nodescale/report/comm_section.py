"""The section of a ``nodescale bench comm`` directory: bus bandwidth per collective at the largest size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nodescale.figures import busbw_figure
from nodescale.report import markdown as md
from nodescale.report.run_section import write_figure
from nodescale.report.sources import CommSource


def human_bytes(count: int) -> str:
    """``134217728`` -> ``"134,217,728 (128 MiB)"``: exact bytes, then the binary unit."""
    value, unit = float(count), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{count:,} ({value:g} {unit})"


def largest_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each (op, dtype, in_place), the row of the largest message size."""
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for row in rows:
        key = (str(row.get("op")), str(row.get("dtype")), str(row.get("in_place")))
        if key not in best or int(row.get("bytes") or 0) > int(best[key].get("bytes") or 0):
            best[key] = row
    return [best[key] for key in sorted(best)]


def _flag(value: Any) -> str:
    return md.MISSING if value is None else ("yes" if value else "no")


def comm_section(comm: CommSource, report_dir: Path, stem: str) -> str:
    """Markdown for one bench comm directory; writes ``STEM-busbw.png`` (regenerated from results.json)."""
    parts = [f"## bench comm `{comm.label}`",
             f"Directory: {md.directory_link(comm.path, report_dir)}. Bandwidths in GB/s (1e9 bytes/s); busbw is "
             "the bus bandwidth, comparable across collectives and world sizes."]
    if comm.rows:
        parts += _sweep_parts(comm, report_dir, stem)
    if comm.pairs is not None:
        parts += pairs_parts(comm.pairs)
    return "\n\n".join(parts)


def pairs_parts(report: dict[str, Any]) -> list[str]:
    """The ``--pairs`` measurement: one row per pair, slow pairs and slow nodes (or ranks) named."""
    unit = str(report.get("unit", "rank"))
    parts = [f"Point-to-point (`--pairs`): sendrecv of {human_bytes(int(report.get('bytes') or 0))} "
             f"{report.get('dtype', '')} between every pair of {unit}s, {report.get('backend', md.MISSING)}; median "
             f"busbw {md.number(report.get('median_busbw_GBps'), 2)} GB/s, slow below "
             f"{md.number(report.get('slow_below_GBps'), 2)} GB/s (half the median)."]
    rows = [(" ↔ ".join(map(str, row.get("pair", []))), ",".join(map(str, row.get("ranks", []))),
             md.number(row.get("time_us"), 1), md.number(row.get("algbw_GBps"), 2), md.number(row.get("busbw_GBps"), 2),
             _flag(row.get("correct")), "**slow**" if row.get("slow") else "") for row in report["pairs"]]
    parts.append(md.table(["pair", "ranks", "time (µs)", "algbw (GB/s)", "busbw (GB/s)", "correct", ""], rows,
                          align_right_from=2))
    slow = [item for item in report.get("units", []) if item.get("slow")]
    if slow:
        parts.append("**Slow " + unit + ("s" if len(slow) > 1 else "") + "**: " + ", ".join(
            f"`{item['unit']}` (median {md.number(item.get('median_busbw_GBps'), 2)} GB/s over its pairs)"
            for item in slow) + ".")
    if report.get("all_correct") is False:
        parts.append("**A pair failed the correctness check**: its bandwidth means nothing.")
    return parts


def _sweep_parts(comm: CommSource, report_dir: Path, stem: str) -> list[str]:
    parts: list[str] = []
    if comm.meta:
        parts.append(md.table(["", "value"], sorted((key, value) for key, value in comm.meta.items())))
    shown = [(str(row.get("op")), str(row.get("dtype", md.MISSING)), _flag(row.get("in_place")),
              human_bytes(int(row.get("bytes") or 0)), str(row.get("world_size", md.MISSING)),
              md.number(row.get("time_us"), 1), md.number(row.get("algbw_GBps"), 2),
              md.number(row.get("busbw_GBps"), 2), _flag(row.get("correct"))) for row in largest_rows(comm.rows)]
    parts.append("Each collective at its largest message size:")
    parts.append(md.table(["op", "dtype", "in place", "size (bytes)", "processes", "time (µs)", "algbw (GB/s)",
                           "busbw (GB/s)", "correct"], shown, align_right_from=3))
    wrong = [row for row in comm.rows if row.get("correct") is False]
    if wrong:
        parts.append(f"**{len(wrong)} measurement(s) failed the correctness check**: their bandwidths mean nothing.")
    parts.append(write_figure(busbw_figure(comm.rows, f"{comm.label}: bus bandwidth"), report_dir, f"{stem}-busbw.png",
                              f"bus bandwidth of {comm.label}"))
    own = comm.path / "busbw.png"
    if own.is_file():
        target = os.path.relpath(own, report_dir)
        parts.append(f"The benchmark's own plot: {md.link(target, target)}.")
    return parts
