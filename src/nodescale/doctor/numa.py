"""Which NUMA node a rank's CPUs and its GPU sit on, and a row when they are not the same.

A rank whose CPUs are on one socket while its GPU hangs off the other copies every batch across
the inter-socket link; torchrun's ``--numa-binding=node`` (``nodescale launch`` passes it where
it works) or ``srun --cpu-bind`` prevents that. Read from sysfs under ``sys_root`` (a directory
argument, so tests can give a fake tree); nothing here raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from nodescale.distributed.rank_labels import rank_ranges, ranks_label
from nodescale.doctor.check import Check, ok, warn

if TYPE_CHECKING:  # facts.py imports this module to gather
    from nodescale.doctor.facts import RankFacts


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (sysfs ``cpulist``) as a set of CPU numbers; empty for a malformed list."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last or first).isdigit():
            return set()
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def node_cpus(sys_root: Path = Path("/sys")) -> dict[int, set[int]]:
    """``{NUMA node: its CPUs}`` from ``devices/system/node/nodeN/cpulist`` (empty where there is none)."""
    found = {}
    for node in (sys_root / "devices/system/node").glob("node[0-9]*"):
        try:
            found[int(node.name[4:])] = parse_cpulist((node / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return found


def nodes_of_cpus(cpus: Iterable[int], nodes: Mapping[int, set[int]]) -> list[int]:
    """The NUMA nodes that hold any of ``cpus``."""
    wanted = set(cpus)
    return sorted(node for node, on_node in nodes.items() if on_node & wanted)


def pci_address(domain: int, bus: int, device: int) -> str:
    """The sysfs name of a GPU from its CUDA properties, as torch's own NUMA binding builds it."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def gpu_node(address: str, sys_root: Path = Path("/sys")) -> int | None:
    """The NUMA node of the PCI device ``address`` (``0000:3b:00.0``); ``None`` when unknown (-1, no file)."""
    try:
        value = int((sys_root / "bus/pci/devices" / address.lower() / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


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
