"""``nodescale report DIR...``: a markdown report of runs and benchmark outputs, with PNG plots."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="markdown report of training runs and bench outputs, with plots; compares several runs",
        description="Read training runs (summary.json + metrics.jsonl), sweeps (sweep.json: members ranked by "
        "validation loss), `nodescale bench scaling` directories (scaling.json) and `nodescale bench comm` "
        "directories (results.json), and write REPORT_DIR/report.md with tables and PNG plots (report-*.png). "
        "Several runs get a side-by-side comparison.",
    )
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run, sweep or benchmark directories")
    parser.add_argument("--out", type=Path, metavar="REPORT_DIR",
                        help="where report.md and its PNGs go (default: DIR itself for one DIR; "
                        "report-<YYYYmmdd-HHMMSS> in the current directory for several)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from nodescale.report.build import build_report

    path = build_report(args.dirs, args.out)
    pngs = sorted(p.name for p in path.parent.glob("report-*.png"))
    print(f"wrote {path}" + (f" and {len(pngs)} plot(s) beside it" if pngs else ""))
    return 0
