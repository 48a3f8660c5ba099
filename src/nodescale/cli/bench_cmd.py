"""``nodescale bench comm|scaling``: one module per benchmark, registered here."""

from __future__ import annotations

import argparse

from nodescale.cli import bench_comm_cmd, bench_scaling_cmd


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure collective bandwidth or training scaling",
        description="Benchmarks with honest numbers: warm-up excluded, synchronised on the device, the slowest "
        "rank's time, units stated (GB/s = 1e9 bytes/s).",
    )
    actions = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    bench_comm_cmd.add_parser(actions)
    bench_scaling_cmd.add_parser(actions)
