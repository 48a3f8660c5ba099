"""Where this process sits in a distributed job, and where its ranks meet.

:func:`detect` answers rank, local rank, world size, node and the rendezvous address as a
:class:`DistEnv`. Which launcher started the process, and what its variables say, is read by
:mod:`nodescale.distributed.launchers` (torchrun, Slurm ``srun``, Cray PALS, Open MPI, MPICH, or a
single process); this module adds the rendezvous address and port.

The rendezvous address is ``MASTER_ADDR`` when set; else 127.0.0.1 when every rank is on this
node; else the first host of the allocation (Slurm node list, ``PBS_NODEFILE``) resolved to an
IP address, since compute nodes may not resolve bare node names the way the login node does.
A Slurm node name that does not resolve is looked up as the job scripts do: its NodeAddr
(``scontrol show node``), so that a plain ``srun python script.py`` meets where names do not resolve.
The port is ``MASTER_PORT`` when set, else derived from the scheduler's job id
(:func:`port_for_job`) so that two jobs sharing a node do not both take 29500.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nodescale.distributed.launchers import read_layout, scheduler_job_id
from nodescale.distributed.layout import Layout, RankPlace
from nodescale.errors import UserError

Resolver = Callable[[str], str]
NodeAddrLookup = Callable[[str], str | None]

DEFAULT_PORT = 29500  # torchrun's default, used when there is no job id to derive one from
JOB_PORT_BASE = 15000
JOB_PORT_SPAN = 15000  # ports 15000..29999: below the Linux ephemeral range (32768+)
LOOPBACK = "127.0.0.1"

_MASTER_ADDR_HINT = (
    "export MASTER_ADDR=<IP address of the node running rank 0> before launching, e.g. "
    "the address of $(head -1 $PBS_NODEFILE) or of $(scontrol show hostnames $SLURM_JOB_NODELIST | head -1)"
)


@dataclass(frozen=True)
class DistEnv(RankPlace):
    """This process's place in the job, and where the ranks meet."""

    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm", "pals", "openmpi", "mpich" or "single"


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


def scontrol_node_addr(node: str) -> str | None:
    """Slurm's NodeAddr of ``node`` (``scontrol show node``); None where Slurm cannot say."""
    if shutil.which("scontrol") is None:
        return None
    try:
        shown = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", shown.stdout)
    return match[1] if shown.returncode == 0 and match else None


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


def detect(environ: Mapping[str, str] | None = None, resolve: Resolver = resolve_ipv4_first,
           node_addr: NodeAddrLookup = scontrol_node_addr) -> DistEnv:
    """Detect rank, world size and rendezvous address from the launcher's variables.

    ``environ`` defaults to :data:`os.environ`; nothing else is read except the node file
    named by ``PBS_NODEFILE``, and only when the rendezvous host must come from it.
    ``resolve`` turns a host name into an address (see :func:`resolve_ipv4_first`); ``node_addr`` gives a
    Slurm node's NodeAddr where its name does not resolve (see :func:`scontrol_node_addr`).

    Raises :class:`UserError` for inconsistent or malformed variables, and for multi-node
    launches whose rendezvous address cannot be found.
    """
    env = os.environ if environ is None else environ
    layout = read_layout(env)
    return DistEnv(
        **layout.place(),
        master_addr=_master_addr(env, layout, resolve, node_addr),
        master_port=_master_port(env),
        source=layout.source,
    )


def _master_addr(env: Mapping[str, str], layout: Layout, resolve: Resolver, node_addr: NodeAddrLookup) -> str:
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
        failure = exc
    # The node list came from Slurm (no PBS node file): ask it for the node's address, as the job scripts do.
    addr = node_addr(head) if env.get("SLURM_JOB_ID") and not env.get("PBS_NODEFILE") else None
    if addr:
        try:
            return resolve(addr)
        except (OSError, UnicodeError, ValueError) as exc:
            failure = exc
    raise UserError(
        f"host {head!r}",
        f"the first node of the allocation does not resolve to an address ({failure})"
        + (f", nor does its Slurm NodeAddr {addr!r}" if addr else ""),
        _MASTER_ADDR_HINT,
    ) from failure


def _master_port(env: Mapping[str, str]) -> int:
    raw = env.get("MASTER_PORT", "").strip()
    if not raw:
        return port_for_job(scheduler_job_id(env))
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise UserError(
            f"MASTER_PORT={raw!r}",
            "must be a port number from 1 to 65535",
            "unset MASTER_PORT to use a port derived from the job id",
        )
    return int(raw)
