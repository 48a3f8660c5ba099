"""A Slurm partition's nodes as ``scontrol`` reports them, for :mod:`nodescale.launch.partition_fit`.

Two calls: ``scontrol show partition -o`` (the partition's nodes, MaxTime, MaxNodes; the Default=YES
partition when the job names none), then ``scontrol show node -o NODES`` (CPUTot, Gres,
RealMemory). ``-o`` prints one record per line as KEY=VALUE words; the parsers are pure.
"""

from __future__ import annotations

import re

from nodescale.launch.partition_fit import Node, Partition, Unreachable, clock_seconds
from nodescale.launch.schedulers.client import client_output

_FIELD = re.compile(r"(\S+?)=(\S*)")
_NO_LIMIT = ("UNLIMITED", "INFINITE", "NONE", "")


def records(text: str) -> list[dict[str, str]]:
    """The KEY=VALUE fields of each record line of ``scontrol show ... -o``."""
    return [dict(_FIELD.findall(line)) for line in text.splitlines() if "=" in line]


def gres_gpus(gres: str, gpu_type: str | None = None) -> int:
    """GPUs in a node's Gres: ``gpu:4``, ``gpu:a100:4(S:0-1)``, ``gpu:a100:2,gpu:v100:2``; of ``gpu_type`` if given."""
    total = 0
    for entry in re.split(r",(?![^(]*\))", gres):
        parts = entry.split("(")[0].split(":")
        if parts[0] != "gpu" or len(parts) < 2 or not parts[-1].isdigit():
            continue
        if gpu_type is None or (len(parts) == 3 and parts[1] == gpu_type):
            total += int(parts[-1])
    return total


def parse_partition(fields: dict[str, str], node_text: str, gpu_type: str | None = None) -> Partition:
    """The partition of a ``scontrol show partition -o`` record with the nodes of ``scontrol show node -o``."""
    nodes = tuple(
        Node(name=node["NodeName"], cpus=int(node.get("CPUTot", "0") or 0),
             gpus=gres_gpus(node.get("Gres", ""), gpu_type),
             memory_mb=int(node["RealMemory"]) if node.get("RealMemory", "").isdigit() else None)
        for node in records(node_text) if "NodeName" in node)
    max_time = fields.get("MaxTime", "")
    max_nodes = fields.get("MaxNodes", "")
    return Partition(
        name=fields["PartitionName"], nodes=nodes,
        max_time=None if max_time.upper() in _NO_LIMIT else max_time,
        max_time_s=None if max_time.upper() in _NO_LIMIT else clock_seconds(max_time),
        max_nodes=int(max_nodes) if max_nodes.isdigit() else None)


def read_partition(name: str | None, gpu_type: str | None = None) -> Partition | Unreachable:
    """The partition ``name`` (None: the default partition) as this machine's Slurm reports it."""
    # Every partition, then the one asked for: the user's --queue never reaches scontrol's argv.
    shown = client_output("scontrol", "show", "partition", "-o")
    if isinstance(shown, Unreachable):
        return shown
    partitions = [fields for fields in records(shown) if "PartitionName" in fields]
    chosen = [fields for fields in partitions
              if (fields["PartitionName"] == name if name else fields.get("Default") == "YES")]
    if not chosen:
        return Unreachable(f"Slurm has no partition {name!r}" if name else
                           "Slurm has no default partition (name one with --queue)")
    node_list = chosen[0].get("Nodes", "")
    nodes = client_output("scontrol", "show", "node", "-o", node_list) if node_list not in ("", "(null)") else ""
    if isinstance(nodes, Unreachable):
        return nodes
    return parse_partition(chosen[0], nodes, gpu_type)
