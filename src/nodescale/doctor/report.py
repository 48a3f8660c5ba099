"""What rank 0 shows: the check table, the per-rank facts table, and ``doctor.json``.

JSON layout (``format`` 1; see docs/doctor.md): ``status``, ``exit_code``, ``counts``,
``checks`` (name, status, detail, hint, blocking), ``ranks`` (each rank's facts with its
``allreduce`` measurement), ``missing_ranks``, ``collective`` (whether it ran, why not,
the backend, the link partners).
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nodescale import __version__
from nodescale.atomic_files import write_json_atomic
from nodescale.doctor.bandwidth import busbw_gbps
from nodescale.doctor.check import FAIL, OK, WARN, Check, counts, exit_code, worst
from nodescale.doctor.evaluate import Plan
from nodescale.doctor.facts import RankFacts

FORMAT = 1
FILE_NAME = "doctor.json"
_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red"}


def document(checks: Sequence[Check], facts: Mapping[int, RankFacts], missing: Sequence[int],
             results: Mapping[int, Mapping[str, Any]], plan: Plan | None, world_size: int,
             timeout_s: float) -> dict[str, Any]:
    """The whole report as JSON-ready data."""
    ranks = []
    for rank in sorted(facts):
        entry = facts[rank].to_dict()
        entry["allreduce"] = dict(results[rank]) if rank in results else None
        ranks.append(entry)
    return {
        "format": FORMAT,
        "nodescale_version": __version__,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "status": worst(checks),
        "exit_code": exit_code(checks),
        "counts": counts(checks),
        "world_size": world_size,
        "timeout_s": timeout_s,
        "checks": [check.to_dict() for check in checks],
        "ranks": ranks,
        "missing_ranks": list(missing),
        "collective": {
            "ran": bool(plan and plan.run),
            "reason": plan.reason if plan else "rank 0 stopped before deciding",
            "backend": plan.backend if plan else None,
            "link_partners": plan.partners if plan else [],
            "link_kind": plan.link_kind if plan else None,
        },
    }


def write(out_dir: Path, doc: Mapping[str, Any]) -> Path:
    """``OUT_DIR/doctor.json``, written atomically (readers never see half a file)."""
    path = out_dir / FILE_NAME
    write_json_atomic(path, doc)
    return path


def print_tables(doc: Mapping[str, Any], stream: Any = None) -> None:
    """The check table, then one row per rank, then the verdict line."""
    from rich.console import Console
    from rich.table import Table

    stream = stream or sys.stdout
    console = Console(file=stream, highlight=False, width=None if stream.isatty() else 160)
    hosts = sorted({rank["host"] for rank in doc["ranks"]})
    checks = Table(title=f"nodescale doctor: {doc['world_size']} rank{'s' if doc['world_size'] != 1 else ''} on "
                   f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}", title_justify="left")
    for column in ("check", "status", "detail", "hint"):
        checks.add_column(column, overflow="fold")
    for row in doc["checks"]:
        checks.add_row(row["name"], f"[{_STYLE[row['status']]}]{row['status']}[/]", row["detail"], row["hint"])
    console.print(checks)
    ranks = Table(title="ranks", title_justify="left", caption="GB/s = 1e9 bytes/s; busbw = algbw x 2(n-1)/n "
                  "(nccl-tests), each rank's own clock", caption_justify="left")
    for column in ("rank", "local", "node", "host", "address", "device", "memory", "CPUs", "NUMA CPUs/GPU", "torch",
                   "CUDA", "NCCL", "Python", "busbw GB/s"):
        ranks.add_column(column, overflow="fold")
    for rank in doc["ranks"]:
        ranks.add_row(*_rank_cells(rank, doc["world_size"]))
    console.print(ranks)
    counted = doc["counts"]
    console.print(f"{counted[OK]} ok, {counted[WARN]} warn, {counted[FAIL]} fail: exit code {doc['exit_code']}")


def _rank_cells(rank: Mapping[str, Any], world_size: int) -> list[str]:
    from nodescale.distributed.rank_labels import rank_ranges

    device = rank["device"] + (f" {rank['device_name']}" if rank.get("device_name") else "")
    memory = f"{rank['device_memory_bytes'] / 2**30:.1f} GiB" if rank.get("device_memory_bytes") else ""
    measured = rank.get("allreduce") or {}
    if measured.get("seconds") and not measured.get("error") and world_size > 1:
        bandwidth = f"{busbw_gbps(int(measured['bytes']), float(measured['seconds']), world_size):.2f}"
    else:
        bandwidth = "-"
    gpu_node = rank.get("gpu_numa_node")
    numa = f"{rank_ranges(rank.get('numa_nodes') or []) or '?'}/{'-' if gpu_node is None else gpu_node}"
    return [str(rank["rank"]), str(rank["local_rank"]), str(rank["node_rank"]), rank["host"],
            rank.get("address") or "?", device, memory, rank_ranges(rank.get("cpu_affinity") or []),
            numa,
            rank.get("torch_version") or "?",
            rank.get("cuda_version") or rank.get("hip_version") or "-", rank.get("nccl_version") or "-",
            rank.get("python_version") or "?", bandwidth]
