"""What ``bench comm`` prints and writes: nccl-tests-like tables, ``results.csv`` and ``results.json``.

One table per operation with nccl-tests' columns: size, count, type, redop, root, then time,
algbw, busbw and #wrong for out-of-place and for in-place. Bandwidths are GB/s = 1e9 bytes/s;
times are microseconds per operation, the slowest rank's.
"""

from __future__ import annotations

import csv
import io
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nodescale.atomic_files import write_json_atomic, write_text_atomic

# The columns of results.csv, in order; results.json rows have the same keys.
COLUMNS: tuple[str, ...] = (
    "op", "bytes", "requested_bytes", "count", "dtype", "redop", "root", "in_place", "time_us", "algbw_GBps",
    "busbw_GBps", "busbw_factor", "wrong", "correct", "world_size", "iterations", "warmup", "backend", "device",
)
UNITS_NOTE = "GB/s = 1e9 bytes/s; time = microseconds per operation, slowest rank"


def console() -> Console:
    """A console for tables: as wide as the terminal, or wide enough for a whole row in a batch log."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def format_time_us(time_us: float) -> str:
    """Microseconds the way nccl-tests prints them: 2 decimals below 100, 1 below 10000, none above."""
    if time_us >= 10000:
        return f"{time_us:.0f}"
    return f"{time_us:.1f}" if time_us >= 100 else f"{time_us:.2f}"


def op_table(op: str, rows: Sequence[dict[str, Any]], title: str) -> Table:
    """The nccl-tests table of one ``op``: one line per size, out-of-place and in-place side by side."""
    table = Table(title=f"{op}: {title}", caption=UNITS_NOTE, title_justify="left", caption_justify="left")
    for header in ("size\n(B)", "count\n(elements)", "type", "redop", "root"):
        table.add_column(header, justify="right")
    for variant in ("out-of-place", "in-place"):
        table.add_column(f"{variant}\ntime (us)", justify="right")
        table.add_column("algbw\n(GB/s)", justify="right")
        table.add_column("busbw\n(GB/s)", justify="right")
        table.add_column("#wrong", justify="right")
    by_size: dict[int, dict[bool, dict[str, Any]]] = {}
    for row in rows:
        by_size.setdefault(row["requested_bytes"], {})[row["in_place"]] = row
    for variants in by_size.values():
        first = variants.get(False) or variants[True]
        cells = [str(first["bytes"]), str(first["count"]), first["dtype"], first["redop"] or "none",
                 str(first["root"]) if first["root"] is not None else "-1"]
        for in_place in (False, True):
            row = variants.get(in_place)
            if row is None:
                cells += ["N/A"] * 4  # not measured: nccl-tests cannot check it either
                continue
            wrong = str(row["wrong"]) if row["correct"] else f"[bold red]{row['wrong']}[/]"
            cells += [format_time_us(row["time_us"]), f"{row['algbw_GBps']:.2f}", f"{row['busbw_GBps']:.2f}", wrong]
        table.add_row(*cells)
    return table


def average_busbw(rows: Sequence[dict[str, Any]]) -> float:
    """nccl-tests' closing "Avg bus bandwidth": the mean busbw over all lines and variants."""
    return statistics.fmean(row["busbw_GBps"] for row in rows) if rows else 0.0


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    """``rows`` as CSV with the :data:`COLUMNS` header; None is an empty cell."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if row.get(key) is None else row[key] for key in COLUMNS})
    return buffer.getvalue()


def write_results(out: Path, rows: Sequence[dict[str, Any]]) -> list[Path]:
    """``out/results.json`` (a list of row objects) and ``out/results.csv``, each written atomically."""
    json_path, csv_path = out / "results.json", out / "results.csv"
    write_json_atomic(json_path, [{key: row.get(key) for key in COLUMNS} for row in rows])
    write_text_atomic(csv_path, csv_text(rows))
    return [json_path, csv_path]


def pairs_table(report: dict[str, Any]) -> Table:
    """The ``--pairs`` table: one line per pair, slow ones marked, then nothing else (units follow in notes)."""
    title = (f"sendrecv between pairs of {report['unit']}s, {report['bytes']} B {report['dtype']}, "
             f"{report['backend']}; median busbw {report['median_busbw_GBps']:.2f} GB/s")
    table = Table(title=title, caption=f"{UNITS_NOTE}; slow = busbw below {report['slow_below_GBps']:.2f} GB/s "
                  "(0.5 x median)", title_justify="left", caption_justify="left")
    for header in ("pair", "ranks", "time (us)", "algbw\n(GB/s)", "busbw\n(GB/s)", "#wrong", "slow"):
        table.add_column(header, justify="left" if header == "pair" else "right")
    for row in report["pairs"]:
        table.add_row(" <-> ".join(row["pair"]), f"{row['ranks'][0]},{row['ranks'][1]}", format_time_us(row["time_us"]),
                      f"{row['algbw_GBps']:.2f}", f"{row['busbw_GBps']:.2f}",
                      str(row["wrong"]) if row["correct"] else f"[bold red]{row['wrong']}[/]",
                      "[bold red]SLOW[/]" if row["slow"] else "")
    return table
