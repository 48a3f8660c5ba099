"""Where this process sits in a distributed job, read from what its launcher set.

:func:`detect` looks at the environment and answers rank, local rank, world size, node and the
rendezvous address for every way the supported clusters start processes. Detectors are tried in
this order and the first that matches wins:

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

The rendezvous address is ``MASTER_ADDR`` when set; else 127.0.0.1 when every rank is on this
node; else the first host of the allocation (Slurm node list, ``PBS_NODEFILE``) resolved to an
IP address, since compute nodes may not resolve bare node names the way the login node does.
The port is ``MASTER_PORT`` when set, else derived from the scheduler's job id
(:func:`port_for_job`) so that two jobs sharing a node do not both take 29500.
"""

from __future__ import annotations

import math
import os
import re
import socket
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from nodescale.dist.hostlist import expand_hostlist, read_nodefile
from nodescale.errors import UserError

Resolver = Callable[[str], str]

DEFAULT_PORT = 29500  # torchrun's default, used when there is no job id to derive one from
JOB_PORT_BASE = 15000
JOB_PORT_SPAN = 15000  # ports 15000..29999: below the Linux ephemeral range (32768+)
LOOPBACK = "127.0.0.1"

# Slurm's reserved step ids (batch script, extern, interactive, pending...) are all >= this.
_SLURM_SPECIAL_STEP_IDS = 0xFFFFFFF0

_MASTER_ADDR_HINT = (
    "export MASTER_ADDR=<IP address of the node running rank 0> before launching, e.g. "
    "the address of $(head -1 $PBS_NODEFILE) or of $(scontrol show hostnames $SLURM_JOB_NODELIST | head -1)"
)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, and where the ranks meet."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm", "pals", "openmpi", "mpich" or "single"

    @property
    def is_distributed(self) -> bool:
        """Whether there is more than one rank."""
        return self.world_size > 1


def resolve_ipv4_first(host: str) -> str:
    """The address of ``host``: its first IPv4 address, else its first IPv6 address.

    IPv4 first because gloo and NCCL socket setups on clusters are configured for it.
    Raises :class:`OSError` when the name does not resolve.
    """
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    for family in (socket.AF_INET, socket.AF_INET6):
        for info in infos:
            if info[0] == family:
                return str(info[4][0])
    raise OSError(f"no IPv4 or IPv6 address for {host!r}")


def port_for_job(job_id: str | None) -> int:
    """The rendezvous port for a scheduler job: ``15000 + (numeric id % 15000)``, or 29500.

    Every rank of a job computes the same port from the same id, and jobs with different ids
    that share a node get different ports. PBS ids such as ``"1234.desched1"`` use their number;
    array members (``"1234[5].server"``) add their index so members of one array, the likeliest
    to share a node, differ. An id with no leading number uses a stable CRC32 of its text
    (Python's ``hash`` differs between processes).
    """
    if job_id is None or not job_id.strip():
        return DEFAULT_PORT
    match = re.match(r"(\d+)(?:\[(\d*)\])?", job_id.strip())
    if match:
        number = int(match.group(1)) + int(match.group(2) or 0)
    else:
        number = zlib.crc32(job_id.strip().encode())
    return JOB_PORT_BASE + number % JOB_PORT_SPAN


def detect(environ: Mapping[str, str] | None = None, resolve: Resolver = resolve_ipv4_first) -> DistEnv:
    """Detect rank, world size and rendezvous address from the launcher's variables.

    ``environ`` defaults to :data:`os.environ`; nothing else is read except the node file
    named by ``PBS_NODEFILE``, and only when the rendezvous host must come from it.
    ``resolve`` turns a host name into an address (see :func:`resolve_ipv4_first`).

    Raises :class:`UserError` for inconsistent or malformed variables, and for multi-node
    launches whose rendezvous address cannot be found.
    """
    env = os.environ if environ is None else environ
    for detector in _DETECTORS:
        layout = detector(env)
        if layout is not None:
            break
    else:  # pragma: no cover - _single always matches
        raise AssertionError("no detector matched")
    layout.check()
    return DistEnv(
        rank=layout.rank,
        local_rank=layout.local_rank,
        world_size=layout.world_size,
        local_world_size=layout.local_world_size,
        node_rank=layout.node_rank,
        num_nodes=layout.num_nodes,
        master_addr=_master_addr(env, layout, resolve),
        master_port=_master_port(env),
        source=layout.source,
    )


@dataclass
class _Layout:
    """What one detector read, with the variable each number came from (for error messages)."""

    source: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    names: dict[str, str]
    hosts: Callable[[], list[str]] = field(default=lambda: [])

    def check(self) -> None:
        self._below("rank", "world_size")
        self._below("local_rank", "local_world_size")
        self._below("node_rank", "num_nodes")
        if self.local_world_size > self.world_size:
            self._fail("local_world_size", f"cannot exceed {self._show('world_size')}")

    def _below(self, small: str, big: str) -> None:
        if getattr(self, small) >= getattr(self, big):
            self._fail(small, f"must be less than {self._show(big)}")

    def _show(self, name: str) -> str:
        return f"{self.names.get(name, name)}={getattr(self, name)}"

    def _fail(self, name: str, rule: str) -> None:
        raise UserError(
            f"{self._show(name)} (from {self.source})",
            rule,
            "these variables are set by the launcher; a job script that exports RANK, WORLD_SIZE "
            "or SLURM_* by hand is the usual cause",
        )


def _torchrun(env: Mapping[str, str]) -> _Layout | None:
    if "TORCHELASTIC_RUN_ID" not in env and not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE", minimum=1)
    local_rank = _int(env, "LOCAL_RANK")
    names = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK"}
    # torchrun sets all of these; DeepSpeed's launcher uses the LOCAL_SIZE/CROSS_* spellings;
    # hand-written environments may have only the first three.
    local_var = _first_set(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE")
    nodes_var = _first_set(env, "GROUP_WORLD_SIZE", "CROSS_SIZE")
    node_var = _first_set(env, "GROUP_RANK", "CROSS_RANK")
    nodes = _int(env, nodes_var, minimum=1) if nodes_var else None
    if local_var:
        local_world = _int(env, local_var, minimum=1)
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
        node_rank = _int(env, node_var)
        names["node_rank"] = node_var
    else:
        node_rank = rank // local_world
        names["node_rank"] = f"RANK/{names['local_world_size']}"
    return _Layout(
        "torchrun",
        rank,
        local_rank,
        world,
        local_world,
        node_rank,
        nodes,
        names,
        hosts=lambda: _allocation_hosts(env),
    )


def _slurm(env: Mapping[str, str]) -> _Layout | None:
    if "SLURM_PROCID" not in env:
        return None
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    if not step.isdigit() or int(step) >= _SLURM_SPECIAL_STEP_IDS:
        return None  # a batch script or salloc shell: not a task of a step
    tasks_var = _first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nodes_var = _first_set(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    per_node_var = _first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tasks_var is None or nodes_var is None:
        raise _missing("SLURM_STEP_NUM_TASKS" if tasks_var is None else "SLURM_STEP_NUM_NODES", "srun")
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, tasks_var, minimum=1)
    if _mpi_disagrees(env, rank, world):
        return None  # this step runs MPI daemons; the MPI ranks are described by MPI's variables
    nodes = _int(env, nodes_var, minimum=1)
    node_rank = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
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
    local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    return _Layout(
        "slurm",
        rank,
        local_rank,
        world,
        local_world,
        node_rank,
        nodes,
        names,
        hosts=lambda: _slurm_hosts(env),
    )


def _pals(env: Mapping[str, str]) -> _Layout | None:
    if "PALS_RANKID" not in env:
        return None
    world_var = _first_set(env, "PMI_SIZE", "PALS_SIZE")
    local_rank_var = _first_set(env, "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK")
    local_var = _first_set(env, "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE")
    for name, var in (
        ("PMI_SIZE", world_var),
        ("PALS_LOCAL_RANKID", local_rank_var),
        ("PALS_LOCAL_SIZE", local_var),
    ):
        if var is None:
            raise _missing(name, "Cray PALS mpiexec")
    assert world_var and local_rank_var and local_var  # for type checkers
    rank = _int(env, "PALS_RANKID")
    world = _int(env, world_var, minimum=1)
    local_world = _int(env, local_var, minimum=1)
    names = {
        "rank": "PALS_RANKID",
        "world_size": world_var,
        "local_rank": local_rank_var,
        "local_world_size": local_var,
    }
    node_rank = _int(env, "PALS_NODEID") if "PALS_NODEID" in env else rank // local_world
    names["node_rank"] = "PALS_NODEID" if "PALS_NODEID" in env else f"PALS_RANKID/{local_var}"
    return _mpi_layout(
        "pals", env, rank, _int(env, local_rank_var), world, local_world, names, node_rank=node_rank
    )


def _openmpi(env: Mapping[str, str]) -> _Layout | None:
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
            raise _missing(var, "Open MPI mpirun")
    # OMPI_COMM_WORLD_NODE_RANK is NOT the node index: it is the rank among all jobs' processes
    # on this node (it equals the local rank in a single job), so the node comes from the rank.
    return _mpi_layout(
        "openmpi",
        env,
        _int(env, names["rank"]),
        _int(env, names["local_rank"]),
        _int(env, names["world_size"], minimum=1),
        _int(env, names["local_world_size"], minimum=1),
        names,
    )


def _mpich(env: Mapping[str, str]) -> _Layout | None:
    if "PMI_RANK" not in env:
        return None
    local_rank_var = _first_set(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
    local_var = _first_set(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
    if "PMI_SIZE" not in env:
        raise _missing("PMI_SIZE", "MPICH mpiexec")
    if local_rank_var is None or local_var is None:
        # Guessing the local rank would put two ranks on one GPU.
        raise _missing("MPI_LOCALRANKID" if local_rank_var is None else "MPI_LOCALNRANKS", "MPICH mpiexec")
    names = {
        "rank": "PMI_RANK",
        "world_size": "PMI_SIZE",
        "local_rank": local_rank_var,
        "local_world_size": local_var,
    }
    return _mpi_layout(
        "mpich",
        env,
        _int(env, "PMI_RANK"),
        _int(env, local_rank_var),
        _int(env, "PMI_SIZE", minimum=1),
        _int(env, local_var, minimum=1),
        names,
    )


def _single(env: Mapping[str, str]) -> _Layout:
    names = {
        name: f"{name} (single process)"
        for name in ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes")
    }
    return _Layout("single", 0, 0, 1, 1, 0, 1, names)


_DETECTORS: tuple[Callable[[Mapping[str, str]], _Layout | None], ...] = (
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
) -> _Layout:
    """An MPI launch: nodes counted assuming the same number of ranks per node, placed in blocks
    (rank 0..L-1 on the first node), which is how mpiexec maps by default."""
    if node_rank is None:
        node_rank = rank // local_world
        names["node_rank"] = f"{names['rank']}/{names['local_world_size']}"
    names["num_nodes"] = f"{names['world_size']}/{names['local_world_size']}"
    nodes = math.ceil(world / local_world)
    return _Layout(
        source,
        rank,
        local_rank,
        world,
        local_world,
        node_rank,
        nodes,
        names,
        hosts=lambda: _allocation_hosts(env),
    )


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
    var = _first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    return expand_hostlist(env[var]) if var else []


def _allocation_hosts(env: Mapping[str, str]) -> list[str]:
    """The allocation's hosts, first host first: the PBS node file, else Slurm's node list."""
    if env.get("PBS_NODEFILE", "").strip():
        return read_nodefile(env["PBS_NODEFILE"].strip())
    return _slurm_hosts(env)


def _master_addr(env: Mapping[str, str], layout: _Layout, resolve: Resolver) -> str:
    if env.get("MASTER_ADDR", "").strip():
        return env["MASTER_ADDR"].strip()
    if layout.local_world_size == layout.world_size:
        return LOOPBACK  # every rank is on this node; no name lookup can go wrong
    hosts = layout.hosts()
    if not hosts:
        raise UserError(
            "MASTER_ADDR",
            f"is not set, and this {layout.source} launch of {layout.world_size} ranks on "
            f"{layout.num_nodes} nodes has no node list (Slurm node list or PBS_NODEFILE) "
            "to find rank 0's node",
            _MASTER_ADDR_HINT,
        )
    head = hosts[0]
    try:
        return resolve(head)
    except (OSError, UnicodeError, ValueError) as exc:
        raise UserError(
            f"host {head!r}",
            f"the first node of the allocation does not resolve to an address ({exc})",
            _MASTER_ADDR_HINT,
        ) from exc


def _master_port(env: Mapping[str, str]) -> int:
    raw = env.get("MASTER_PORT", "").strip()
    if not raw:
        return port_for_job(_first_value(env, "SLURM_JOB_ID", "SLURM_JOBID", "PBS_JOBID"))
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise UserError(
            f"MASTER_PORT={raw!r}",
            "must be a port number from 1 to 65535",
            "unset MASTER_PORT to use a port derived from the job id",
        )
    return int(raw)


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    """An integer variable, with the variable and its value named when it is not one."""
    if name not in env:
        raise _missing(name, "the launcher")
    raw = env[name]
    if not re.fullmatch(r"[+-]?\d+", raw.strip()):
        raise UserError(f"{name}={raw!r}", "is not an integer")
    value = int(raw.strip())
    if value < minimum:
        raise UserError(
            f"{name}={raw!r}", "must not be negative" if minimum == 0 else f"must be at least {minimum}"
        )
    return value


def _first_set(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` that is set to something non-blank."""
    return next((name for name in names if env.get(name, "").strip()), None)


def _first_value(env: Mapping[str, str], *names: str) -> str | None:
    name = _first_set(env, *names)
    return env[name] if name else None


def _missing(name: str, launcher: str) -> UserError:
    return UserError(
        name,
        f"is not set, but other variables say this process was started by {launcher}",
        "launch with an unmodified launcher, or set RANK, WORLD_SIZE, LOCAL_RANK and "
        "LOCAL_WORLD_SIZE yourself",
    )
