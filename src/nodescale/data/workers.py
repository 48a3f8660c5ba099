"""How many DataLoader worker processes a rank starts when the user gives no ``data.num_workers``.

A rank may use the CPUs of its binding (``os.sched_getaffinity``). Ranks of one node whose CPU
sets overlap (no ``--cpu-bind``: every rank sees the whole node, or the job's cgroup) share
those CPUs, so each takes its part of them; one CPU of a rank's part stays with the rank's own
process (the training loop, collation, the copy to the device).
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nodescale.distributed.process_group import Runtime

# More workers than this seldom feed one accelerator faster, and each holds a copy of the dataset's state.
MAX_WORKERS = 16


def default_workers(mine: frozenset[int], same_node: list[frozenset[int]], cap: int = MAX_WORKERS) -> int:
    """Workers for a rank bound to CPUs ``mine``, among the CPU sets of its node's ranks (its own included).

    The ranks whose sets overlap ``mine`` divide it evenly; the rank's process keeps one CPU.
    """
    sharing = max(1, sum(1 for cpus in same_node if cpus & mine))
    return max(0, min(cap, len(mine) // sharing - 1))


def rank_cpus() -> frozenset[int]:
    """The CPUs this process may run on (all of them where the system cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def workers_for_rank(runtime: Runtime) -> int:
    """:func:`default_workers` for this rank: one all-gather tells it the CPU sets of its node's ranks.

    Every rank must call it (it is a collective where a process group is up).
    """
    from nodescale.distributed.process_group import gather_from_all

    mine = rank_cpus()
    everyone = gather_from_all(runtime, (socket.gethostname(), runtime.env.node_rank, mine))
    here = (socket.gethostname(), runtime.env.node_rank)
    return default_workers(mine, [cpus for host, node, cpus in everyone if (host, node) == here])
