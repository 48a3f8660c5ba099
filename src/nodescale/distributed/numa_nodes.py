"""Which CPUs each NUMA node holds and which NUMA node a GPU hangs off, read from sysfs.

``sys_root`` is a directory argument so tests can give a fake tree. Used by a rank binding itself
near its GPU (cpu_binding.py) and by ``doctor``'s locality row (doctor/numa.py); nothing here raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path


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
