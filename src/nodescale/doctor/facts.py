"""Everything one rank can find out about itself without talking to any other rank.

:func:`gather` runs on every rank before any process group exists. It never raises: what it
cannot find is ``None`` or an entry of ``problems``, so a rank with a broken CUDA install or
a resolver that hangs still reports, and the table shows the problem instead of a traceback.
The result is plain data (:class:`RankFacts`), sent to rank 0 as JSON.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from nodescale.distributed import numa_nodes as numa
from nodescale.distributed.env import DistEnv
from nodescale.doctor import host, names

# Scheduler variables the launch checks compare with the run (only these are sent: the rest of
# a job's environment may hold tokens and has no business in a report).
SCHEDULER_VARIABLES = (
    "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_PROCID", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_TASK", "SLURM_JOB_NODELIST", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    "PBS_JOBID", "PBS_NODEFILE",
)

# Set by `nodescale doctor --nproc N` for its workers: the file rank 0 writes the verdict to
# (see cli/doctor_cmd.py). Its presence also tells the launch checks who started the ranks.
VERDICT_VARIABLE = "NODESCALE_DOCTOR_VERDICT"

RESOLVE_TIMEOUT_S = 10.0


@dataclass
class RankFacts:
    """One rank's view of itself, the job and its host."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    source: str  # the launcher nodescale.distributed.env detected
    launcher: str  # who started the ranks, in words
    host: str
    pid: int
    master_addr: str
    master_port: int
    master_resolved: str | None = None
    master_error: str | None = None
    address: str | None = None  # this host's address on the route to the master
    host_resolved: str | None = None  # what the host name resolves to (gloo's default address)
    device: str = "cpu"
    device_name: str | None = None
    device_memory_bytes: int | None = None
    device_uuid: str | None = None
    gpu_count: int = 0
    backend: str = "gloo"  # what this rank would choose for the requested backend
    backends_available: list[str] = field(default_factory=list)
    cpu_affinity: list[int] = field(default_factory=list)
    cpu_count: int = 0
    numa_nodes: list[int] = field(default_factory=list)  # the NUMA nodes of cpu_affinity
    numa_node_count: int = 0  # on this host (0: not Linux, or no sysfs)
    gpu_numa_node: int | None = None  # this rank's GPU's node; None: no GPU, or the kernel does not know
    torch_version: str = ""
    cuda_version: str | None = None
    hip_version: str | None = None
    nccl_version: str | None = None
    python_version: str = ""
    python_executable: str = ""
    interfaces: dict[str, dict[str, Any]] = field(default_factory=dict)
    comm_env: dict[str, str] = field(default_factory=dict)
    scheduler_env: dict[str, str] = field(default_factory=dict)
    pbs_nodes: list[str] | None = None  # rank 0 only: distinct hosts of PBS_NODEFILE
    pbs_slots: int | None = None  # rank 0 only: its lines (PBS writes one per MPI process)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankFacts:
        """Facts sent by another rank; unknown keys (a newer nodescale) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def gather(env: DistEnv, requested_backend: str, environ: Mapping[str, str] | None = None) -> RankFacts:
    """This rank's facts, for the ``requested_backend`` (auto, gloo or nccl)."""
    environ = os.environ if environ is None else environ
    facts = RankFacts(
        **env.place(), source=env.source, launcher=launcher_of(env.source, environ), host=socket.gethostname(),
        pid=os.getpid(),
        master_addr=env.master_addr, master_port=env.master_port,
    )
    facts.master_resolved, facts.master_error = host.resolve(env.master_addr, RESOLVE_TIMEOUT_S)
    if facts.master_resolved:
        facts.address = host.outbound_address(facts.master_resolved, env.master_port)
    facts.host_resolved, _ = host.resolve(facts.host, RESOLVE_TIMEOUT_S)
    facts.cpu_affinity = host.cpu_affinity()
    facts.cpu_count = os.cpu_count() or len(facts.cpu_affinity)
    nodes = numa.node_cpus()
    facts.numa_node_count, facts.numa_nodes = len(nodes), numa.nodes_of_cpus(facts.cpu_affinity, nodes)
    facts.python_version = sys.version.split()[0]
    facts.python_executable = sys.executable
    facts.interfaces = host.interfaces()
    facts.comm_env = names.communication_variables(environ)
    facts.scheduler_env = {name: environ[name] for name in SCHEDULER_VARIABLES if name in environ}
    if env.rank == 0 and environ.get("PBS_NODEFILE", "").strip():
        facts.pbs_nodes, facts.pbs_slots = _read_nodefile(environ["PBS_NODEFILE"].strip(), facts.problems)
    _torch_facts(env, requested_backend, facts)
    return facts


def launcher_of(source: str, environ: Mapping[str, str]) -> str:
    """Who started this process, as the table says it."""
    if environ.get(VERDICT_VARIABLE):
        return "nodescale doctor --nproc"
    if source == "torchrun" and "TORCHELASTIC_RUN_ID" not in environ:
        # RANK/WORLD_SIZE/LOCAL_RANK exported per task (nodescale launch --mode per-gpu) or by hand.
        if "SLURM_PROCID" in environ:
            return "srun, with RANK/WORLD_SIZE per task"
        if any(name in environ for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID")):
            return "mpiexec, with RANK/WORLD_SIZE per task"
        return "RANK/WORLD_SIZE set by hand"
    return {"torchrun": "torchrun", "slurm": "srun", "pals": "mpiexec (Cray PALS)", "openmpi": "mpirun (Open MPI)",
            "mpich": "mpiexec (MPICH)", "single": "a single process"}.get(source, source)


def _torch_facts(env: DistEnv, requested_backend: str, facts: RankFacts) -> None:
    try:
        import torch
        import torch.distributed as dist

        from nodescale.distributed.process_group import choose_backend, select_device
    except Exception as exc:  # a broken torch install is exactly what the doctor must report
        facts.problems.append(f"import torch failed: {exc}")
        return
    facts.torch_version = torch.__version__
    facts.cuda_version = torch.version.cuda
    facts.hip_version = getattr(torch.version, "hip", None)
    facts.backends_available = [name for name, available in (
        ("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()), ("mpi", dist.is_mpi_available()),
    ) if available]
    try:
        facts.gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        with warnings.catch_warnings():
            # select_device warns about shared GPUs; the doctor reports that as a row instead.
            warnings.simplefilter("ignore")
            device = select_device(env)
        facts.device = str(device)
        if device.type == "cuda":
            properties = torch.cuda.get_device_properties(device)
            facts.device_name = properties.name
            facts.device_memory_bytes = int(properties.total_memory)
            uuid = getattr(properties, "uuid", None)
            facts.device_uuid = str(uuid) if uuid is not None else None
            if hasattr(properties, "pci_bus_id"):  # CUDA builds of recent torch (ROCm: where it has them)
                facts.gpu_numa_node = numa.gpu_node(numa.pci_address(
                    properties.pci_domain_id, properties.pci_bus_id, properties.pci_device_id))
    except Exception as exc:  # CUDA driver/runtime mismatches raise here on the broken node only
        facts.problems.append(f"CUDA device query failed: {exc}")
        facts.device = "cpu"
    facts.backend = choose_backend(requested_backend, torch.device(facts.device))
    if "nccl" in facts.backends_available:
        try:
            version = torch.cuda.nccl.version()
            facts.nccl_version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:
            facts.problems.append(f"NCCL version query failed: {exc}")


def _read_nodefile(path: str, problems: list[str]) -> tuple[list[str] | None, int | None]:
    """The node file's distinct hosts and its number of lines (slots)."""
    from pathlib import Path

    from nodescale.distributed.hostlist import read_nodefile

    try:
        slots = sum(1 for line in Path(path).read_text().splitlines() if line.split("#", 1)[0].strip())
        return read_nodefile(path), slots
    except Exception as exc:  # UserError or OSError: report, do not stop
        problems.append(f"PBS_NODEFILE {path}: {exc}")
        return None, None
