"""A torchrun worker binds itself to the CPUs nearest its GPU where nothing bound it before.

The job scripts pass torchrun ``--numa-binding=node`` only where it can work (launch/numa_binding.py);
elsewhere (a torch without it, torchrun started by hand) every worker may run on any of the node's
CPUs and copy each batch across the inter-socket link. So at start-up a worker takes its GPU's
NUMA node from sysfs, or entry LOCAL_RANK of the preset's per-task list (LUMI's masks, which srun
applies only in per-gpu mode), intersected with the CPUs it may use. It leaves a process that is
already within one NUMA node alone (torchrun's binding, ``srun --cpu-bind``, numactl), and
``NODESCALE_CPU_BIND=none`` turns this off. Binding never fails a run: a problem is one warning.
No torch import here: the job-script renderers import the names.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescale.distributed import numa_nodes
from nodescale.distributed.rank_labels import rank_ranges

log = logging.getLogger(__name__)

VARIABLE = "NODESCALE_CPU_BIND"  # "none": leave the workers as started; a per-task list: the preset's rule
OFF = ("none", "off", "0", "no", "false")
# Slurm's --cpu-bind lists, one entry per task on a node, and PALS mpiexec's (list:, mask:).
PER_TASK_BINDINGS = ("map_", "mask_", "list:", "mask:")
_warned: list[str] = []


@dataclass(frozen=True)
class Choice:
    cpus: frozenset[int] | None  # None: leave this process as it is
    why: str
    warn: bool = False  # worth telling the user: binding was wanted and could not be done


def _cpus_of_mask(text: str) -> set[int]:
    bits = int(text, 16)
    return {cpu for cpu in range(bits.bit_length()) if bits >> cpu & 1}


def rule_cpus(rule: str, local_rank: int, nodes: Mapping[int, Set[int]]) -> set[int] | None:
    """The CPUs of entry ``local_rank`` of a per-task list (reused from the start when short, as Slurm does).

    None for a list this does not read; raises ValueError for a malformed entry.
    """
    kind, _, values = rule.partition(":")
    entries = [entry for entry in values.split("," if kind.endswith(("_cpu", "_ldom")) else ":") if entry]
    if kind not in ("map_cpu", "mask_cpu", "map_ldom", "mask_ldom", "list", "mask") or not entries:
        return None
    entry = entries[local_rank % len(entries)]
    if kind == "map_cpu":
        return {int(entry, 16) if entry.lower().startswith("0x") else int(entry)}
    if kind == "list":
        return numa_nodes.parse_cpulist(entry) or None
    if kind.endswith("_ldom"):
        ldoms = {int(entry)} if kind == "map_ldom" else _cpus_of_mask(entry)
        return set().union(*(nodes.get(ldom, set()) for ldom in ldoms))
    return _cpus_of_mask(entry)


def choose(local_rank: int, allowed: Set[int], nodes: Mapping[int, Set[int]], gpu_numa_node: int | None,
           rule: str = "") -> Choice:
    """Where this worker should run: a pure decision over what sysfs and the scheduler said."""
    if rule.lower() in OFF:
        return Choice(None, f"{VARIABLE}={rule}: binding is off")
    if len(nodes) < 2:
        return Choice(None, "one NUMA node: nothing to choose")
    if len(numa_nodes.nodes_of_cpus(allowed, nodes)) <= 1:
        return Choice(None, "already within one NUMA node (torchrun --numa-binding, srun --cpu-bind, numactl)")
    if rule:
        try:
            wanted = rule_cpus(rule, local_rank, nodes)
        except ValueError:
            wanted = None
        if wanted is None:
            return Choice(None, f"{VARIABLE}={rule!r} is not a per-task list (map_cpu, mask_cpu, map_ldom, "
                          "mask_ldom, list:, mask:); left unbound", warn=True)
        source = f"the preset's {rule.partition(':')[0]} entry {local_rank}"
    elif gpu_numa_node is None or gpu_numa_node not in nodes:
        return Choice(None, "no GPU on a known NUMA node")
    else:
        wanted, source = set(nodes[gpu_numa_node]), f"its GPU's NUMA node {gpu_numa_node}"
    cpus = wanted & set(allowed)
    if not cpus:
        return Choice(None, f"none of the CPUs this process may use ({rank_ranges(sorted(allowed))}) are on "
                      f"{source} ({rank_ranges(sorted(wanted))}); left unbound", warn=True)
    if cpus == set(allowed):
        return Choice(None, f"its CPUs are {source}'s already")
    return Choice(frozenset(cpus), source)


def gpu_numa_node(device: Any, sys_root: Path) -> int | None:
    """The NUMA node of a CUDA/ROCm ``torch.device`` (None: not a GPU, or a torch that does not say)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    properties = torch.cuda.get_device_properties(device)
    if not hasattr(properties, "pci_bus_id"):
        return None
    return numa_nodes.gpu_node(numa_nodes.pci_address(
        properties.pci_domain_id, properties.pci_bus_id, properties.pci_device_id), sys_root)


def set_affinity(cpus: Set[int]) -> None:
    """Every thread of this process (torch may have started some) on ``cpus``; later threads inherit it."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def warn_once(message: str) -> None:
    if not _warned:
        _warned.append(message)
        warnings.warn(f"CPU binding: {message} (set {VARIABLE}=none to skip it)", stacklevel=3)


def bind_near_gpu(source: str, local_rank: int, device: Any, environ: Mapping[str, str] = os.environ,
                  sys_root: Path = Path("/sys")) -> frozenset[int] | None:
    """Under torchrun (``source``), bind this worker as :func:`choose` says; the CPUs bound, or None. Never raises."""
    if source != "torchrun" or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        choice = choose(local_rank, os.sched_getaffinity(0), numa_nodes.node_cpus(sys_root),
                        gpu_numa_node(device, sys_root), environ.get(VARIABLE, "").strip())
        if choice.cpus:
            set_affinity(choice.cpus)
            log.info("local rank %d bound to CPUs %s (%s)", local_rank, rank_ranges(sorted(choice.cpus)), choice.why)
        elif choice.warn:
            warn_once(choice.why)
        return choice.cpus
    except Exception as exc:  # binding is an optimisation: a failure must not end the run
        warn_once(f"could not bind local rank {local_rank}: {exc}")
        return None
