"""A whole ``bench comm`` run on one rank: measure on every rank, print and write on rank 0.

Every rank holds the same rows at the end (times and wrong counts are all-reduced), so only rank 0
prints the tables and writes the files; the others measure and return.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nodescale import bad_nodes
from nodescale.atomic_files import write_json_atomic
from nodescale.bench import comm_report
from nodescale.bench.comm import bench_device, run_sweep
from nodescale.bench.comm_math import Settings
from nodescale.distributed.process_group import Runtime


def describe(runtime: Runtime, settings: Settings) -> str:
    """The setting of a run in one line: ranks, backend, device, type, iterations."""
    ranks = "1 rank" if runtime.world_size == 1 else f"{runtime.world_size} ranks"
    return (f"{ranks}, {runtime.backend}, {bench_device(runtime).type}, {settings.dtype}, "
            f"{settings.warmup} warm-up + {settings.iters} timed iterations")


def sweep(runtime: Runtime, settings: Settings, out: Path, plot: bool = True) -> bool:
    """Run every op at every size; rank 0 prints the tables and writes results.json/.csv and busbw.png.

    Returns whether every result was correct.
    """
    console = comm_report.console() if runtime.is_main else None
    setting = describe(runtime, settings)
    if console:
        console.print(f"# nodescale bench comm: {setting} -> {out}", soft_wrap=True)

    def on_op_done(op: str, rows: list[dict[str, Any]]) -> None:
        if console:
            console.print(comm_report.op_table(op, rows, setting))
            console.print(f"# {op}: avg bus bandwidth {comm_report.average_busbw(rows):.3f} GB/s\n")

    def on_skip(note: str) -> None:
        if console:
            console.print(f"[yellow]note:[/] {note}", soft_wrap=True)

    rows = run_sweep(runtime, settings, on_op_done, on_skip)
    wrong = sum(row["wrong"] for row in rows)
    if console:
        written = comm_report.write_results(out, rows)
        if plot:
            from nodescale.figures import busbw_figure, save_png  # matplotlib: only when plotting

            figure = busbw_figure(rows, f"busbw vs size: {setting}")
            if figure is not None:
                save_png(figure, out / "busbw.png")
                written.append(out / "busbw.png")
        verdict = "OK" if wrong == 0 else "[bold red]FAILED[/]"
        console.print(f"# wrong elements: {wrong} {verdict}", soft_wrap=True)
        console.print(f"# wrote {', '.join(str(path) for path in written)}", soft_wrap=True)
    return wrong == 0


def pairs(runtime: Runtime, settings: Settings, out: Path) -> bool:
    """Send/recv between every pair; rank 0 prints the pair table and writes pairs.json. Whether all were correct."""
    from nodescale.bench.comm_pairs import run_pairs

    report = run_pairs(runtime, settings)
    if runtime.is_main:
        console = comm_report.console()
        console.print(comm_report.pairs_table(report))
        for unit in report["units"]:
            if unit["slow"]:
                console.print(f"[bold red]slow {report['unit']}:[/] {unit['unit']} (median busbw "
                              f"{unit['median_busbw_GBps']:.2f} GB/s over its pairs)", soft_wrap=True)
        path = out / "pairs.json"
        write_json_atomic(path, report)
        console.print(f"# wrote {path}", soft_wrap=True)
        for line in bad_nodes.record(slow_nodes(report), out, "bench comm --pairs"):
            console.print(line, soft_wrap=True, markup=False)
    return bool(report["all_correct"])


def slow_nodes(report: dict[str, Any]) -> dict[str, str]:
    """host -> reason for each slow node of a ``--pairs`` report (none when the units are one node's ranks)."""
    if report["unit"] != "node":
        return {}
    return {unit["unit"]: f"bench comm --pairs: median sendrecv busbw {unit['median_busbw_GBps']:.2f} GB/s over its "
            f"pairs, below {report['slow_below_GBps']:.2f} (0.5x the median)"
            for unit in report["units"] if unit["slow"]}
