"""Which NUMA node a rank's CPUs and its GPU sit on, and a row when they are not the same.

A rank whose CPUs are on one socket while its GPU hangs off the other copies every batch across
the inter-socket link; torchrun's ``--numa-binding=node`` (``nodescale launch`` passes it where
it works) or ``srun --cpu-bind`` prevents that. The sysfs reading is
nodescale.distributed.numa_nodes; nothing here raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from nodescale.distributed.rank_labels import rank_ranges, ranks_label
from nodescale.doctor.check import Check, ok, warn

if TYPE_CHECKING:  # facts.py imports this module to gather
    from nodescale.doctor.facts import RankFacts


def check_locality(facts: Mapping[int, RankFacts]) -> Check:
    """``cpu.numa``: each rank's CPUs lie on its GPU's NUMA node.

    A GPU whose node the kernel does not know (-1, VMs) cannot be judged and is left out.
    """
    name = "cpu.numa"
    far, spread, judged = [], [], []
    for rank, f in sorted(facts.items()):
        if f.gpu_numa_node is None or not f.numa_nodes or f.numa_node_count < 2:
            continue
        judged.append(rank)
        if f.gpu_numa_node not in f.numa_nodes:
            far.append(f"rank {rank} on {f.host}: CPUs on NUMA node {rank_ranges(f.numa_nodes)}, "
                       f"its GPU on node {f.gpu_numa_node}")
        elif len(f.numa_nodes) > 1:
            spread.append(rank)
    if far or spread:
        if spread:  # not bound: the scheduler may move them to the far node at any time
            far.append(f"{ranks_label(spread)} may run on NUMA nodes {rank_ranges(facts[spread[0]].numa_nodes)}, "
                       "not only their GPU's")
        return warn(name, "; ".join(far), "bind each rank to its GPU's NUMA node: nodescale launch (torchrun "
                    "--numa-binding=node), srun --cpu-bind=ldoms, or numactl --cpunodebind=N")
    most = max((f.numa_node_count for f in facts.values()), default=0)
    if most < 2:
        return ok(name, "one NUMA node per host: nothing to bind")
    if not judged:
        return ok(name, f"up to {most} NUMA nodes per host; no GPU on a known NUMA node to compare with")
    return ok(name, f"{ranks_label(judged)}: CPUs on their GPU's NUMA node")
