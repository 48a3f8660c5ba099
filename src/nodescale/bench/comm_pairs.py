"""``bench comm --pairs``: send/recv between every pair of nodes, one pair at a time, to find a slow one.

A "unit" is a node: the lowest rank on each node stands for it. When every rank is on one node
(a laptop, a single-node test) each rank is its own unit, so the pairs are pairs of ranks.
For each pair, only its two ranks run nccl-tests' sendrecv (both send and receive at once) on a
two-rank subgroup; every other rank waits at a barrier, so nothing else shares the links. The
subgroups are created by every rank in the same order, as torch.distributed requires.

A pair whose busbw is below :data:`SLOW_FRACTION` of the median of all pairs is flagged, and so
is a unit whose own median (over its pairs) is: one slow node makes all of its pairs slow.
With three units a slow node is two of three pairs, so the median itself is slow; the
comparison needs about five nodes or more to point at one.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Sequence
from datetime import timedelta
from itertools import combinations
from typing import Any

import torch.distributed as dist

from nodescale.bench import comm_math
from nodescale.bench.comm import group_barrier, make_group, measure
from nodescale.bench.comm_math import Settings
from nodescale.distributed.process_group import Runtime, gather_from_all

SLOW_FRACTION = 0.5


def units_of(node_ranks: Sequence[int], hosts: Sequence[str]) -> tuple[str, list[int], list[str]]:
    """(kind, representative rank per unit, unit names) for the ranks' node indices and host names.

    >>> units_of([0, 0, 1, 1], ["a", "a", "b", "b"])
    ('node', [0, 2], ['a', 'b'])
    >>> units_of([0, 0, 0], ["a", "a", "a"])
    ('rank', [0, 1, 2], ['a:rank0', 'a:rank1', 'a:rank2'])
    """
    if len(set(node_ranks)) > 1:
        firsts = {node: node_ranks.index(node) for node in sorted(set(node_ranks))}
        return "node", list(firsts.values()), [hosts[rank] for rank in firsts.values()]
    return "rank", list(range(len(node_ranks))), [f"{hosts[r]}:rank{r}" for r in range(len(node_ranks))]


def run_pairs(runtime: Runtime, settings: Settings) -> dict[str, Any]:
    """Measure every pair of units at the largest size of ``settings``; the report, identical on every rank."""
    gathered = gather_from_all(runtime, (runtime.env.node_rank, socket.gethostname()))
    kind, representatives, names = units_of([g[0] for g in gathered], [g[1] for g in gathered])
    size = max(settings.sizes)
    element = comm_math.DTYPE_BYTES[settings.dtype]
    world = make_group(runtime, settings.dtype)
    rows: list[dict[str, Any]] = []
    for a, b in combinations(range(len(representatives)), 2):
        ranks = (representatives[a], representatives[b])
        # Every rank calls new_group, in the same order; with the job's timeout, not torch's 30 minutes.
        subgroup = dist.new_group(list(ranks), timeout=timedelta(seconds=runtime.timeout_s))
        if runtime.rank in ranks:
            pair = make_group(runtime, settings.dtype, subgroup, ranks)
            counts = comm_math.op_counts("sendrecv", size, element, 2)
            row = measure("sendrecv", counts, False, pair, settings)
            row.update(backend=runtime.backend, device=str(pair.device), pair=[names[a], names[b]], ranks=list(ranks))
            if pair.rank == 0:
                rows.append(row)
        group_barrier(world)  # the other ranks wait here while the pair runs
        dist.destroy_process_group(subgroup)
    pairs = [row for part in gather_from_all(runtime, rows) for row in part]
    pairs.sort(key=lambda row: row["ranks"])
    return summarise(pairs, kind, names, size, runtime, settings)


def summarise(pairs: list[dict[str, Any]], kind: str, names: list[str], size: int, runtime: Runtime,
              settings: Settings) -> dict[str, Any]:
    """Flag slow pairs and slow units (below :data:`SLOW_FRACTION` x the median busbw)."""
    median = statistics.median(row["busbw_GBps"] for row in pairs) if pairs else 0.0
    threshold = SLOW_FRACTION * median
    for row in pairs:
        row["slow"] = row["busbw_GBps"] < threshold
    units = []
    for name in names:
        own = [row["busbw_GBps"] for row in pairs if name in row["pair"]]
        own_median = statistics.median(own) if own else 0.0
        units.append({"unit": name, "median_busbw_GBps": own_median, "slow": bool(own) and own_median < threshold,
                      "slow_pairs": sum(1 for row in pairs if name in row["pair"] and row["slow"])})
    return {
        "unit": kind,
        "op": "sendrecv",
        "bytes": comm_math.op_counts("sendrecv", size, comm_math.DTYPE_BYTES[settings.dtype], 2).bytes,
        "dtype": settings.dtype,
        "iterations": settings.iters,
        "warmup": settings.warmup,
        "world_size": runtime.world_size,
        "backend": runtime.backend,
        "median_busbw_GBps": median,
        "slow_below_GBps": threshold,
        "pairs": pairs,
        "units": units,
        "all_correct": all(row["correct"] for row in pairs),
    }
