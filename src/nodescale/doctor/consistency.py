"""The same software and hardware everywhere: versions, devices, backends, CPU pinning.

Pure functions over every rank's facts. Mismatched NCCL or torch versions between nodes are a
classic source of hangs and garbage results (a module loaded on the login node but not in the
job, one node with an older image); they are failures. A different Python executable with the
same versions is only suspicious (two copies of one environment), a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from nodescale.distributed.rank_labels import rank_ranges, ranks_label
from nodescale.doctor.check import Check, fail, ok, plural, warn
from nodescale.doctor.facts import RankFacts
from nodescale.doctor.launch_math import gpus_of_node

# (row name, what to call it, fact, status when it differs)
_VERSIONS: tuple[tuple[str, str, Callable[[RankFacts], str | None], str], ...] = (
    ("versions.torch", "torch", lambda f: f.torch_version or None, "fail"),
    ("versions.cuda", "CUDA (torch build)", lambda f: f.cuda_version or f.hip_version, "fail"),
    ("versions.nccl", "NCCL", lambda f: f.nccl_version, "fail"),
    ("versions.python", "Python", lambda f: f.python_version or None, "fail"),
    ("versions.executable", "Python executable", lambda f: f.python_executable or None, "warn"),
)


def _groups(facts: Mapping[int, RankFacts], value: Callable[[RankFacts], object]) -> dict[object, list[int]]:
    groups: dict[object, list[int]] = {}
    for rank, f in sorted(facts.items()):
        groups.setdefault(value(f), []).append(rank)
    return groups


def _describe(groups: Mapping[object, list[int]], facts: Mapping[int, RankFacts]) -> str:
    parts = []
    for value, ranks in groups.items():
        hosts = sorted({facts[rank].host for rank in ranks})
        where = f"{', '.join(hosts[:3])}{', ...' if len(hosts) > 3 else ''}"
        parts.append(f"{value if value is not None else 'none'} on {ranks_label(ranks)} ({where})")
    return "; ".join(parts)


def check_versions(facts: Mapping[int, RankFacts]) -> list[Check]:
    """torch, its CUDA, NCCL, Python and the interpreter path are the same on every rank."""
    rows = []
    for name, label, value, status in _VERSIONS:
        groups = _groups(facts, value)
        if len(groups) == 1:
            only = next(iter(groups))
            if only is None and name in ("versions.cuda", "versions.nccl"):
                rows.append(ok(name, f"no {label.split()[0]} in this torch build (CPU only), on every rank"))
            else:
                rows.append(ok(name, f"{label} {only} on every rank"))
            continue
        detail = f"{label} differs: {_describe(groups, facts)}"
        hint = ("load the same modules / activate the same environment on every node (module load in the job "
                "script, not in ~/.bashrc of the login node), and use one container image everywhere")
        rows.append(fail(name, detail, hint) if status == "fail" else warn(name, detail, hint))
    return rows


def check_devices(facts: Mapping[int, RankFacts], backend: str) -> list[Check]:
    """One backend and one kind of device everywhere, and the same GPU count on every node."""
    rows = []
    kinds = _groups(facts, lambda f: f.device.split(":")[0])
    backends = _groups(facts, lambda f: f.backend)
    unavailable = [rank for rank, f in facts.items() if f.backends_available and backend not in f.backends_available]
    if unavailable:
        rows.append(fail("devices.backend", f"{backend} is not available in torch on {ranks_label(unavailable)} "
                         f"({facts[unavailable[0]].torch_version})",
                         "nccl needs a CUDA build of torch and a GPU; use --backend gloo to test the network "
                         "without GPUs", blocking=True))
    elif len(kinds) > 1 or len(backends) > 1:
        rows.append(fail("devices.backend", f"ranks differ: devices {_describe(kinds, facts)}; backends "
                         f"{_describe(backends, facts)}",
                         "every rank needs the same kind of device: a node without visible GPUs (driver, "
                         "CUDA_VISIBLE_DEVICES) makes its ranks fall back to the CPU", blocking=backend == "nccl"))
    else:
        rows.append(ok("devices.backend", f"{backend} on {next(iter(kinds))} on every rank"))
    by_node: dict[int, list[RankFacts]] = {}
    for f in facts.values():
        by_node.setdefault(f.node_rank, []).append(f)
    counts: dict[int, list[int]] = {}
    for node, ranks in sorted(by_node.items()):
        counts.setdefault(gpus_of_node(ranks)[0], []).append(node)
    if len(counts) > 1:
        listed = "; ".join(f"{count} on nodes {rank_ranges(nodes)}" for count, nodes in sorted(counts.items()))
        rows.append(warn("devices.gpus_per_node", f"GPUs per node differ: {listed}",
                         "a fixed --nproc-per-node leaves GPUs idle or shares them on the odd nodes; ask the "
                         "scheduler for whole nodes of one type"))
    else:
        count = next(iter(counts))
        rows.append(ok("devices.gpus_per_node", f"{plural(count, 'GPU')} on each of {plural(len(by_node), 'node')}"))
    problems = [(rank, problem) for rank, f in sorted(facts.items()) for problem in f.problems]
    for rank, problem in problems:
        rows.append(warn("facts.incomplete", f"rank {rank} ({facts[rank].host}): {problem}",
                         "the rank could not read this about itself; run the same command there by hand"))
    return rows


def check_affinity(facts: Mapping[int, RankFacts]) -> Check:
    """Ranks of one host are not pinned to the same few CPUs.

    ``srun`` without ``--cpus-per-task``, or a ``taskset`` in a wrapper, can pin every rank of a
    node to the same core or two: the data loaders and the communication threads then queue
    behind each other.
    """
    name = "cpu.affinity"
    by_host: dict[str, list[RankFacts]] = {}
    for f in facts.values():
        by_host.setdefault(f.host, []).append(f)
    clashes = []
    pinned = False
    for host, ranks in sorted(by_host.items()):
        for f in ranks:
            if f.cpu_affinity and len(f.cpu_affinity) < f.cpu_count:
                pinned = True
        seen: dict[tuple[int, ...], list[int]] = {}
        for f in ranks:
            cpus = tuple(f.cpu_affinity)
            if cpus and len(cpus) < f.cpu_count:
                seen.setdefault(cpus, []).append(f.rank)
        for cpus, ranks_on in seen.items():
            if len(ranks_on) > 1:
                clashes.append(f"{ranks_label(ranks_on)} on {host} all pinned to CPUs {rank_ranges(cpus)} of "
                               f"{ranks[0].cpu_count}")
    if clashes:
        return warn(name, "; ".join(clashes), "give each task its own cores: srun --cpus-per-task=C --cpu-bind=cores "
                    "(or mpiexec's --cpu-bind / --bind-to core), or remove the taskset/numactl wrapper")
    if pinned:
        return ok(name, "each rank pinned to its own CPUs")
    sizes = sorted({len(f.cpu_affinity) for f in facts.values()})
    return ok(name, f"not pinned: every rank may use all {'/'.join(map(str, sizes))} CPUs of its host")
