"""The launch arithmetic: ranks that reported, world size = nodes x processes per node, and
the scheduler's request against what actually runs.

Pure functions over the ranks' facts. The traps they catch, each seen in real job scripts:

* a rank that never reaches the rendezvous (wrong MASTER_ADDR, fewer processes than
  WORLD_SIZE): the others wait for it until their timeout;
* ranks disagreeing on WORLD_SIZE, or two processes claiming one rank;
* a Slurm job that asked for 4 tasks per node running 2 processes (``--ntasks-per-node``
  versus the devices), or a batch script starting the program once, outside ``srun``;
* processes per node versus GPUs per node: idle GPUs, or processes sharing one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodescale.distributed.rank_labels import rank_ranges, ranks_label
from nodescale.doctor.check import Check, fail, ok, plural, warn
from nodescale.doctor.facts import RankFacts

# Slurm's reserved step ids (batch, extern, interactive) are all >= this (see distributed/env.py).
_SLURM_SPECIAL_STEP_IDS = 0xFFFFFFF0


def check_reported(world_size: int, missing: Sequence[int], timeout_s: float, master: str) -> Check:
    """Every rank of the world reported its facts within the timeout."""
    name = "launch.ranks_reported"
    if not missing:
        if world_size == 1:
            return ok(name, "one rank: nobody to wait for")
        return ok(name, f"all {world_size} ranks reached the rendezvous at {master}")
    who = ranks_label(missing)
    return fail(name, f"{who} of {world_size} did not report within {timeout_s:g} s",
                f"check that {who} was started at all (srun/mpiexec task counts, WORLD_SIZE), that its node "
                f"can reach {master} (firewall, MASTER_ADDR), and its own error output", blocking=True)


def check_claims(facts: Mapping[int, RankFacts], world_size: int, claims: Mapping[int, int]) -> Check:
    """Ranks agree on the world size and no rank number is claimed by two processes.

    ``claims`` counts the processes that said "I am rank r" (a store counter): two processes
    with the same rank overwrite each other's facts, so only the counter sees them.
    """
    name = "launch.rank_numbers"
    sizes: dict[int, list[int]] = {}
    for rank, f in facts.items():
        sizes.setdefault(f.world_size, []).append(rank)
    if len(sizes) > 1:
        said = "; ".join(f"{ranks_label(ranks)} say{'s' if len(ranks) == 1 else ''} {size}"
                         for size, ranks in sorted(sizes.items()))
        return fail(name, f"the ranks disagree on the world size: {said}",
                    "the launcher's variables differ between nodes: one launch line for all nodes, and no "
                    "WORLD_SIZE exported by hand", blocking=True)
    doubled = {rank: count for rank, count in claims.items() if count > 1}
    if doubled:
        listed = ", ".join(f"rank {rank} by {count}" for rank, count in sorted(doubled.items()))
        return fail(name, f"rank numbers claimed by several processes: {listed}",
                    "two launchers started the same ranks (e.g. srun --ntasks-per-node=4 around torchrun, "
                    "which starts 4 workers itself): use one launcher per node for torchrun", blocking=True)
    return ok(name, f"ranks 0-{world_size - 1} each claimed by one process" if world_size > 1 else "rank 0 of 1")


def check_layout(facts: Mapping[int, RankFacts], world_size: int) -> list[Check]:
    """World size = the sum of processes per node, every node's ranks on one host, local ranks unique."""
    rows = []
    by_node: dict[int, list[RankFacts]] = {}
    for f in facts.values():
        by_node.setdefault(f.node_rank, []).append(f)
    first = facts[min(facts)]
    per_node = {node: ranks[0].local_world_size for node, ranks in by_node.items()}
    # Nodes nobody reported from are assumed to be like rank 0's (the missing ranks have their own row).
    expected = sum(per_node.get(node, first.local_world_size) for node in range(first.num_nodes))
    uniform = len(set(per_node.values())) == 1
    layout = (f"{plural(first.num_nodes, 'node')} x {plural(first.local_world_size, 'process', 'processes')}"
              if uniform else f"{first.num_nodes} nodes with {sorted(per_node.items())} processes")
    if expected != world_size:
        rows.append(fail("launch.world_size", f"world size {world_size} != {layout} = {expected}",
                         "WORLD_SIZE must equal nodes x processes per node: check --nnodes/--nproc-per-node, "
                         "or the tasks per node the scheduler started"))
    else:
        rows.append(ok("launch.world_size", f"{plural(world_size, 'rank')} = {layout} (started by {first.launcher})"))
    problems = []
    for node, ranks in sorted(by_node.items()):
        hosts = sorted({f.host for f in ranks})
        local = sorted(f.local_rank for f in ranks)
        if len(hosts) > 1:
            problems.append(f"node {node}'s ranks run on several hosts ({', '.join(hosts)})")
        if len(set(local)) != len(local):
            problems.append(f"node {node} ({hosts[0]}) has local ranks {local}: two processes share a local rank "
                            "(and its GPU)")
    if problems:
        rows.append(fail("launch.nodes", "; ".join(problems),
                         "GROUP_RANK/SLURM_NODEID and LOCAL_RANK come from the launcher: start one launcher per "
                         "node, or one task per process with the scheduler's own variables"))
    else:
        shared = _hosts_with_several_nodes(by_node)
        if shared:
            rows.append(warn("launch.nodes", f"several node ranks on one host: {shared}",
                             "fine for containers or network namespaces; otherwise two launchers run on one node"))
        else:
            hosts = sorted({ranks[0].host for ranks in by_node.values()})
            rows.append(ok("launch.nodes", f"{plural(len(by_node), 'node')} "
                           f"({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}), local ranks unique"))
    return rows


def _hosts_with_several_nodes(by_node: Mapping[int, list[RankFacts]]) -> str:
    nodes_of: dict[str, list[int]] = {}
    for node, ranks in by_node.items():
        nodes_of.setdefault(ranks[0].host, []).append(node)
    return "; ".join(f"{host}: nodes {rank_ranges(nodes)}" for host, nodes in sorted(nodes_of.items())
                     if len(nodes) > 1)


@dataclass(frozen=True)
class Allocation:
    """What the scheduler was asked for, from rank 0's Slurm or PBS variables."""

    scheduler: str  # "slurm" or "pbs"
    tasks: int | None
    nodes: int | None
    in_step: bool  # a Slurm job step (srun), not the batch script
    described: str  # the variables, for messages


def _number(env: Mapping[str, str], *names: str) -> tuple[int | None, str | None]:
    for name in names:
        raw = env.get(name, "").strip()
        match = re.match(r"\d+", raw)
        if match:
            return int(match.group()), f"{name}={raw}"
    return None, None


def _tasks_from_spec(spec: str) -> int | None:
    """Total tasks of a Slurm tasks-per-node spec such as ``4(x2),3``."""
    total = 0
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            return None
        total += int(match.group(1)) * int(match.group(2) or 1)
    return total


def allocation(rank0: RankFacts) -> Allocation | None:
    """The scheduler's request as rank 0 sees it; ``None`` outside Slurm and PBS jobs."""
    env = rank0.scheduler_env
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID", "").strip()
        in_step = step.isdigit() and int(step) < _SLURM_SPECIAL_STEP_IDS
        described = []
        if in_step:  # the step's own counts; the job's go stale in a smaller step (see distributed/env.py)
            tasks, shown_tasks = _number(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
            nodes, shown_nodes = _number(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        else:
            tasks, shown_tasks = _number(env, "SLURM_NTASKS")
            nodes, shown_nodes = _number(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
            if tasks is None and env.get("SLURM_TASKS_PER_NODE"):
                tasks = _tasks_from_spec(env["SLURM_TASKS_PER_NODE"])
                shown_tasks = f"SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']}" if tasks else None
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE" if in_step else "SLURM_NTASKS_PER_NODE")
        described = [text for text in (shown_tasks, shown_nodes) if text]
        if per_node:
            described.append(f"{'SLURM_STEP_TASKS_PER_NODE' if in_step else 'SLURM_NTASKS_PER_NODE'}={per_node}")
        return Allocation("slurm", tasks, nodes, in_step, ", ".join(described) or "no task counts")
    if env.get("PBS_JOBID") and rank0.pbs_slots is not None and rank0.pbs_nodes is not None:
        nodes = len(rank0.pbs_nodes)
        return Allocation("pbs", rank0.pbs_slots, nodes, True,
                          f"PBS_NODEFILE: {plural(rank0.pbs_slots, 'slot')} on {plural(nodes, 'node')}")
    return None


def check_allocation(alloc: Allocation | None, rank0: RankFacts) -> Check:
    """The run matches the scheduler's request: as many ranks as tasks, or one launcher per node.

    Under a Slurm batch script (no step) nodescale and torchrun see the job's request but were
    started once: a job of 4 tasks running 2 processes is the ntasks-per-node-vs-devices trap,
    and a job of N > 1 tasks running one process means ``srun`` was forgotten.
    """
    name = "launch.scheduler"
    world, nodes = rank0.world_size, rank0.num_nodes
    run = f"world size {world} ({plural(nodes, 'node')} x {rank0.local_world_size})"
    if alloc is None:
        return ok(name, f"not inside a Slurm or PBS job; {rank0.launcher} started {plural(world, 'rank')}")
    label = "Slurm job step" if alloc.scheduler == "slurm" and alloc.in_step else (
        "Slurm job" if alloc.scheduler == "slurm" else "PBS job")
    asked = f"the {label} asked for {alloc.described}"
    if rank0.source == "slurm":
        return ok(name, f"srun started the step's {world} tasks; {asked}")
    if alloc.nodes is not None and nodes < alloc.nodes and not alloc.in_step:
        return fail(name, f"{run} uses {nodes} of the job's {alloc.nodes} nodes; {asked}", _start_hint(rank0, alloc))
    if alloc.tasks is None:
        return ok(name, f"{run}; {asked} (no task count to compare)")
    if alloc.tasks == world:
        return ok(name, f"{run} = the job's {alloc.tasks} tasks ({alloc.described})")
    if alloc.tasks == nodes and (alloc.in_step or alloc.tasks == 1):
        return ok(name, f"{run}: one launcher per node ({alloc.described}), {rank0.local_world_size} processes each")
    return fail(name, f"{run}, but the {label} asked for {alloc.tasks} tasks ({alloc.described})",
                _start_hint(rank0, alloc))


def _start_hint(rank0: RankFacts, alloc: Allocation) -> str:
    if rank0.source == "single":
        return ("started once, outside srun/mpiexec: run `srun nodescale doctor` (or `nodescale launch ... -- "
                "nodescale doctor`), one task per GPU")
    tasks = f"{alloc.tasks} tasks" if alloc.tasks else "the job's tasks"
    return (f"start one process per task ({tasks}: `nodescale doctor --nproc {alloc.tasks or 'N'}` on one node, "
            "`srun nodescale doctor` on several), or ask the scheduler for as many tasks per node as you run "
            "processes (--ntasks-per-node); with torchrun, one task per node")


def gpus_of_node(ranks: Sequence[RankFacts]) -> tuple[int, str]:
    """A node's GPUs and where that number comes from: the most any of its sources says.

    ``SLURM_GPUS_ON_NODE`` counts the node's GPUs even where each task sees one (per-task
    binding); torch's device count and ``CUDA_VISIBLE_DEVICES`` are the fallback.
    """
    best, source = 0, "torch sees none"
    for f in ranks:
        slurm, _ = _number(f.scheduler_env, "SLURM_GPUS_ON_NODE")
        if slurm is not None and slurm > best:
            best, source = slurm, f"SLURM_GPUS_ON_NODE={slurm}"
        if f.gpu_count > best:
            best, source = f.gpu_count, "torch.cuda.device_count()"
    return best, source


def check_gpus_per_node(facts: Mapping[int, RankFacts], backend: str) -> list[Check]:
    """Processes per node against GPUs per node, and no two processes of a host on one GPU."""
    name = "launch.gpus_per_node"
    by_node: dict[int, list[RankFacts]] = {}
    for f in facts.values():
        by_node.setdefault(f.node_rank, []).append(f)
    rows = []
    for node, ranks in sorted(by_node.items()):
        host = ranks[0].host
        processes = ranks[0].local_world_size
        gpus, source = gpus_of_node(ranks)
        seen = max(f.gpu_count for f in ranks)
        if gpus == 0:
            continue
        if seen == 0:
            rows.append(warn(name, f"node {node} ({host}) has {plural(gpus, 'GPU')} ({source}) "
                             f"but torch {ranks[0].torch_version} sees none: the job runs on the CPU",
                             "install a CUDA (or ROCm) build of torch, or check the driver with nvidia-smi"))
        elif processes > gpus:
            rows.append(fail(name, f"node {node} ({host}): {processes} processes share {gpus} GPUs ({source})",
                             "one process per GPU: ask for as many GPUs as tasks per node (--gpus-per-node, "
                             "--ntasks-per-node) or start fewer processes", blocking=backend == "nccl"))
        elif processes < gpus:
            rows.append(warn(name, f"node {node} ({host}): {plural(processes, 'process', 'processes')} "
                             f"for {gpus} GPUs ({source}): {gpus - processes} idle",
                             f"start {gpus} processes per node (--nproc-per-node {gpus}, or "
                             f"--ntasks-per-node={gpus} with one GPU per task)"))
    rows += _shared_devices(facts, backend)
    if not rows:
        gpu_nodes = [node for node, ranks in by_node.items() if gpus_of_node(ranks)[0] > 0]
        if gpu_nodes:
            rows.append(ok(name, f"one process per GPU on {plural(len(gpu_nodes), 'node')}"))
        else:
            per_node = sorted({ranks[0].local_world_size for ranks in by_node.values()})
            counts = "/".join(map(str, per_node))
            rows.append(ok(name, f"CPU only: {counts} {'process' if per_node == [1] else 'processes'} per node, "
                           "no GPUs to match"))
    return rows


def _shared_devices(facts: Mapping[int, RankFacts], backend: str) -> list[Check]:
    users: dict[tuple[str, str], list[int]] = {}
    for rank, f in facts.items():
        if f.device.startswith("cuda"):
            # Without a UUID, "cuda:0" of two tasks with different CUDA_VISIBLE_DEVICES are two GPUs.
            visible = f.scheduler_env.get("CUDA_VISIBLE_DEVICES", "")
            key = f.device_uuid or f"{f.device} (CUDA_VISIBLE_DEVICES={visible})"
            users.setdefault((f.host, key), []).append(rank)
    shared = {key: ranks for key, ranks in users.items() if len(ranks) > 1}
    if not shared:
        return []
    listed = "; ".join(f"{ranks_label(ranks)} on {host} use {device}" for (host, device), ranks in shared.items())
    return [fail("launch.gpu_sharing", listed, "each rank needs its own GPU (NCCL refuses a communicator with a "
                 "GPU twice): check CUDA_VISIBLE_DEVICES and LOCAL_RANK", blocking=backend == "nccl")]
