"""A PBS Pro queue's nodes as ``pbsnodes -a -F json`` and ``qstat -Q -f -F json`` report them.

For :mod:`nodescale.launch.partition_fit`: each node's ``resources_available`` (ncpus, ngpus,
mem), and the queue's ``resources_max`` (walltime, nodect). A node bound to a queue (its
``queue`` attribute) serves that queue only; any other node serves every queue. The parsers
are pure; :func:`read_queue` runs the two commands.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nodescale.launch.partition_fit import Node, Partition, Unreachable, clock_seconds
from nodescale.launch.schedulers.client import client_output

_SIZE = re.compile(r"^(\d+)([kmgtp]?)(b|w)?$", re.I)
_SIZE_MB = {"": 1 / 1024 ** 2, "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 ** 2, "p": 1024 ** 3}


def size_mb(value: object) -> int | None:
    """A PBS size (``527672488kb``, ``256gb``, bytes when bare) in MB; None when it is none."""
    match = _SIZE.match(str(value).strip())
    if not match:
        return None
    words = 8 if (match[3] or "").lower() == "w" else 1  # a PBS word is 8 bytes
    return int(int(match[1]) * words * _SIZE_MB[match[2].lower()])


def parse_nodes(text: str, queue: str | None) -> tuple[Node, ...]:
    """The nodes of ``pbsnodes -a -F json`` that run jobs of ``queue`` (None: every node)."""
    found = []
    for name, node in (_json(text).get("nodes") or {}).items():
        if queue and node.get("queue") not in (None, queue):
            continue
        available: dict[str, Any] = node.get("resources_available") or {}
        found.append(Node(name=name, cpus=_int(available.get("ncpus", node.get("pcpus"))),
                          gpus=_int(available.get("ngpus")), memory_mb=size_mb(available.get("mem", ""))))
    return tuple(found)


def parse_queue(text: str, queue: str, nodes: tuple[Node, ...]) -> Partition:
    """``queue`` of ``qstat -Q -f -F json`` with its ``nodes``: the walltime and node-count maxima."""
    limits = ((_json(text).get("Queue") or {}).get(queue) or {}).get("resources_max") or {}
    walltime = limits.get("walltime")
    nodect = limits.get("nodect")
    return Partition(name=queue, nodes=nodes, kind="queue", max_time=walltime,
                     max_time_s=clock_seconds(str(walltime)) if walltime else None,
                     max_nodes=_int(nodect) if nodect is not None else None)


def read_queue(queue: str | None) -> Partition | Unreachable:
    """The queue ``queue`` (None: the server's nodes, no queue limits) as this machine's PBS reports it."""
    nodes = client_output("pbsnodes", "-a", "-F", "json")
    if isinstance(nodes, Unreachable):
        return nodes
    found = parse_nodes(nodes, queue)
    if not queue:
        return Partition(name="(default)", nodes=found, kind="queue")
    limits = client_output("qstat", "-Q", "-f", "-F", "json")  # every queue: --queue stays out of argv
    if isinstance(limits, Unreachable):
        return limits
    return parse_queue(limits, queue, found)


def _json(text: str) -> dict[str, Any]:
    try:
        loaded = json.loads(text)
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _int(value: object) -> int:
    return int(value) if isinstance(value, int) or str(value).isdigit() else 0
