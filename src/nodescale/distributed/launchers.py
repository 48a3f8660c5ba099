"""Which launcher started this process, and the rank layout its variables give.

:func:`read_layout` tries one detector per launcher, in this order, and the first that matches
wins:

1. ``torchrun`` / torch elastic (``TORCHELASTIC_RUN_ID``, or ``RANK`` + ``WORLD_SIZE`` +
   ``LOCAL_RANK``). Its variables beat everything else, because under ``srun torchrun`` or
   ``mpiexec ... torchrun`` the scheduler's variables describe the one launcher per node, not
   the workers.
2. Slurm tasks started by ``srun``. Only a task of a job *step* counts: a batch script also
   has ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` of the whole job, but no ``SLURM_STEP_ID``
   (observed on Slurm 22.05); treating it as rank 0 of N would wait forever for N-1 ranks
   that nobody started. The step's own variables (``SLURM_STEP_NUM_TASKS``,
   ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_STEP_NODELIST``) are preferred because the job-wide
   ones go stale in a smaller step (``srun -n1`` inside a 4-task job keeps
   ``SLURM_NTASKS_PER_NODE=2``). A step whose tasks are MPI launcher daemons (``mpirun`` inside
   an allocation starts its daemons with ``srun``) is recognised by MPI ranks that disagree
   with Slurm's, and left to the MPI detectors.
3. Cray PALS ``mpiexec`` under PBS Pro (NCAR Derecho): ``PALS_RANKID`` and friends.
4. Open MPI ``mpirun``: ``OMPI_COMM_WORLD_*``.
5. MPICH / Hydra (and Intel MPI) ``mpiexec``: ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``.
6. Otherwise a single process: rank 0 of 1.

Each detector also says where its allocation's host list is (Slurm node list,
``PBS_NODEFILE``), for finding rank 0's node, and :func:`scheduler_job_id` gives the job id.
Turning the layout into a :class:`~nodescale.distributed.env.DistEnv` with a rendezvous address and
port is :mod:`nodescale.distributed.env`'s job.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

from nodescale.distributed.hostlist import expand_hostlist, read_nodefile
from nodescale.distributed.layout import Layout, first_set, first_value, int_var, missing
from nodescale.errors import UserError

# Slurm's reserved step ids (batch script, extern, interactive, pending...) are all >= this.
_SLURM_SPECIAL_STEP_IDS = 0xFFFFFFF0


def read_layout(env: Mapping[str, str]) -> Layout:
    """The layout from the first detector that matches ``env``, checked for consistency."""
    for detector in _DETECTORS:
        layout = detector(env)
        if layout is not None:
            break
    else:  # pragma: no cover - _single always matches
        raise AssertionError("no detector matched")
    layout.check()
    return layout


def scheduler_job_id(env: Mapping[str, str]) -> str | None:
    """The scheduler's job id (Slurm or PBS), or None outside a batch job."""
    return first_value(env, "SLURM_JOB_ID", "SLURM_JOBID", "PBS_JOBID")


def _torchrun(env: Mapping[str, str]) -> Layout | None:
    if "TORCHELASTIC_RUN_ID" not in env and not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    rank = int_var(env, "RANK")
    world = int_var(env, "WORLD_SIZE", minimum=1)
    local_rank = int_var(env, "LOCAL_RANK")
    names = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK"}
    # torchrun sets all of these; DeepSpeed's launcher uses the LOCAL_SIZE/CROSS_* spellings;
    # hand-written environments may have only the first three.
    local_var = first_set(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE")
    nodes_var = first_set(env, "GROUP_WORLD_SIZE", "CROSS_SIZE")
    node_var = first_set(env, "GROUP_RANK", "CROSS_RANK")
    nodes = int_var(env, nodes_var, minimum=1) if nodes_var else None
    if local_var:
        local_world = int_var(env, local_var, minimum=1)
        names["local_world_size"] = local_var
    else:
        local_world = world // nodes if nodes else world
        names["local_world_size"] = "WORLD_SIZE/GROUP_WORLD_SIZE" if nodes else "WORLD_SIZE"
    if nodes is None:
        nodes = math.ceil(world / local_world)
        names["num_nodes"] = f"WORLD_SIZE/{names['local_world_size']}"
    else:
        names["num_nodes"] = str(nodes_var)
    if node_var:
        node_rank = int_var(env, node_var)
        names["node_rank"] = node_var
    else:
        node_rank = rank // local_world
        names["node_rank"] = f"RANK/{names['local_world_size']}"
    return Layout(source="torchrun", rank=rank, local_rank=local_rank, world_size=world,
                  local_world_size=local_world, node_rank=node_rank, num_nodes=nodes, names=names,
                  hosts=lambda: _allocation_hosts(env))


def _slurm(env: Mapping[str, str]) -> Layout | None:
    if "SLURM_PROCID" not in env:
        return None
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    if not step.isdigit() or int(step) >= _SLURM_SPECIAL_STEP_IDS:
        return None  # a batch script or salloc shell: not a task of a step
    tasks_var = first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nodes_var = first_set(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    per_node_var = first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tasks_var is None or nodes_var is None:
        raise missing("SLURM_STEP_NUM_TASKS" if tasks_var is None else "SLURM_STEP_NUM_NODES", "srun")
    rank = int_var(env, "SLURM_PROCID")
    world = int_var(env, tasks_var, minimum=1)
    if _mpi_disagrees(env, rank, world):
        return None  # this step runs MPI daemons; the MPI ranks are described by MPI's variables
    nodes = int_var(env, nodes_var, minimum=1)
    node_rank = int_var(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    names = {
        "rank": "SLURM_PROCID",
        "world_size": tasks_var,
        "local_rank": "SLURM_LOCALID",
        "node_rank": "SLURM_NODEID",
        "num_nodes": nodes_var,
    }
    if per_node_var:
        counts = _tasks_per_node(per_node_var, env[per_node_var])
        if node_rank >= len(counts):
            raise UserError(
                f"SLURM_NODEID={node_rank}", f"names no node of {per_node_var}={env[per_node_var]!r}"
            )
        local_world = counts[node_rank]
        names["local_world_size"] = per_node_var
    else:
        local_world = max(1, world // nodes)
        names["local_world_size"] = f"{tasks_var}/{nodes_var}"
    local_rank = int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    return Layout(source="slurm", rank=rank, local_rank=local_rank, world_size=world,
                  local_world_size=local_world, node_rank=node_rank, num_nodes=nodes, names=names,
                  hosts=lambda: _slurm_hosts(env))


def _pals(env: Mapping[str, str]) -> Layout | None:
    if "PALS_RANKID" not in env:
        return None
    world_var = first_set(env, "PMI_SIZE", "PALS_SIZE")
    local_rank_var = first_set(env, "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK")
    local_var = first_set(env, "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE")
    for name, var in (
        ("PMI_SIZE", world_var),
        ("PALS_LOCAL_RANKID", local_rank_var),
        ("PALS_LOCAL_SIZE", local_var),
    ):
        if var is None:
            raise missing(name, "Cray PALS mpiexec")
    assert world_var and local_rank_var and local_var  # for type checkers
    rank = int_var(env, "PALS_RANKID")
    world = int_var(env, world_var, minimum=1)
    local_world = int_var(env, local_var, minimum=1)
    names = {
        "rank": "PALS_RANKID",
        "world_size": world_var,
        "local_rank": local_rank_var,
        "local_world_size": local_var,
    }
    node_rank = int_var(env, "PALS_NODEID") if "PALS_NODEID" in env else rank // local_world
    names["node_rank"] = "PALS_NODEID" if "PALS_NODEID" in env else f"PALS_RANKID/{local_var}"
    return _mpi_layout(
        "pals", env, rank, int_var(env, local_rank_var), world, local_world, names, node_rank=node_rank
    )


def _openmpi(env: Mapping[str, str]) -> Layout | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    names = {
        "rank": "OMPI_COMM_WORLD_RANK",
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
    }
    for var in names.values():
        if var not in env:
            raise missing(var, "Open MPI mpirun")
    # OMPI_COMM_WORLD_NODE_RANK is NOT the node index: it is the rank among all jobs' processes
    # on this node (it equals the local rank in a single job), so the node comes from the rank.
    return _mpi_layout(
        "openmpi",
        env,
        int_var(env, names["rank"]),
        int_var(env, names["local_rank"]),
        int_var(env, names["world_size"], minimum=1),
        int_var(env, names["local_world_size"], minimum=1),
        names,
    )


def _mpich(env: Mapping[str, str]) -> Layout | None:
    if "PMI_RANK" not in env:
        return None
    local_rank_var = first_set(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
    local_var = first_set(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
    if "PMI_SIZE" not in env:
        raise missing("PMI_SIZE", "MPICH mpiexec")
    if local_rank_var is None or local_var is None:
        # Guessing the local rank would put two ranks on one GPU.
        raise missing("MPI_LOCALRANKID" if local_rank_var is None else "MPI_LOCALNRANKS", "MPICH mpiexec")
    names = {
        "rank": "PMI_RANK",
        "world_size": "PMI_SIZE",
        "local_rank": local_rank_var,
        "local_world_size": local_var,
    }
    return _mpi_layout(
        "mpich",
        env,
        int_var(env, "PMI_RANK"),
        int_var(env, local_rank_var),
        int_var(env, "PMI_SIZE", minimum=1),
        int_var(env, local_var, minimum=1),
        names,
    )


def _single(env: Mapping[str, str]) -> Layout:
    names = {
        name: f"{name} (single process)"
        for name in ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes")
    }
    return Layout(0, 0, 1, 1, 0, 1, source="single", names=names)


_DETECTORS: tuple[Callable[[Mapping[str, str]], Layout | None], ...] = (
    _torchrun,
    _slurm,
    _pals,
    _openmpi,
    _mpich,
    _single,
)


def _mpi_layout(
    source: str,
    env: Mapping[str, str],
    rank: int,
    local_rank: int,
    world: int,
    local_world: int,
    names: dict[str, str],
    node_rank: int | None = None,
) -> Layout:
    """An MPI launch: nodes counted assuming the same number of ranks per node, placed in blocks
    (rank 0..L-1 on the first node), which is how mpiexec maps by default."""
    if node_rank is None:
        node_rank = rank // local_world
        names["node_rank"] = f"{names['rank']}/{names['local_world_size']}"
    names["num_nodes"] = f"{names['world_size']}/{names['local_world_size']}"
    nodes = math.ceil(world / local_world)
    return Layout(source=source, rank=rank, local_rank=local_rank, world_size=world,
                  local_world_size=local_world, node_rank=node_rank, num_nodes=nodes, names=names,
                  hosts=lambda: _allocation_hosts(env))


def _mpi_disagrees(env: Mapping[str, str], rank: int, world: int) -> bool:
    """Whether an MPI runtime numbers this process differently from Slurm.

    Observed on Slurm 22.05: ``mpirun`` (Open MPI) and ``mpiexec`` (Hydra) inside an sbatch job
    start one daemon per node with ``srun``; their ranks inherit that step's variables, e.g.
    ``SLURM_PROCID=0`` for both MPI ranks 0 and 1 and ``SLURM_STEP_NUM_TASKS=2`` in a 4-rank run.
    ``srun --mpi=pmi2/pmix/cray_shasta`` sets MPI ranks equal to Slurm's, which agree.
    """
    for var, expected in (
        ("OMPI_COMM_WORLD_RANK", rank),
        ("OMPI_COMM_WORLD_SIZE", world),
        ("PMI_RANK", rank),
        ("PMI_SIZE", world),
        ("PMIX_RANK", rank),
    ):
        if var in env and env[var].strip() != str(expected):
            return True
    return False


def _tasks_per_node(var: str, spec: str) -> list[int]:
    """Expand Slurm's tasks-per-node spec: ``"4(x2),3"`` -> [4, 4, 3]."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise UserError(f"{var}={spec!r}", "is not a Slurm tasks-per-node list like '4(x2),3'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _slurm_hosts(env: Mapping[str, str]) -> list[str]:
    var = first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    return expand_hostlist(env[var]) if var else []


def _allocation_hosts(env: Mapping[str, str]) -> list[str]:
    """The allocation's hosts, first host first: the PBS node file, else Slurm's node list."""
    if env.get("PBS_NODEFILE", "").strip():
        return read_nodefile(env["PBS_NODEFILE"].strip())
    return _slurm_hosts(env)
