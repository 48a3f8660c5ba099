"""Process-group start-up and clean shutdown, and the device each rank uses.

One ``Runtime`` per process says who it is (``DistEnv``), which device it
drives and whether a process group is up. Start-up binds one device per local
rank; shutdown follows the sequence that avoids gloo's crash at interpreter
exit (a work object destroyed during teardown aborts ~30% of runs otherwise).

The c10d store (the key-value server every rank meets at) listens on the job's
address only where nodescale creates it: torch's ``TCPStore`` binds every interface
unless it is handed a socket already bound (``master_listen_fd``), so
:func:`listening_store` binds one to ``MASTER_ADDR`` (or loopback) first. See
docs/security.md for what torch's own launchers still open.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nodescale.distributed import cpu_binding
from nodescale.distributed.accelerators import check_backend
from nodescale.distributed.env import DistEnv
from nodescale.distributed.ports import listening_socket

log = logging.getLogger(__name__)

# Set to "any" to let torch bind the store to every interface, as it does by default.
STORE_BIND_VARIABLE = "NODESCALE_STORE_BIND"


@dataclass
class Runtime:
    """Who this process is, the device it drives and its collective backend."""

    env: DistEnv
    device: torch.device
    backend: str | None  # None when no process group was started
    # False when the caller's script had started the group: then it is the script's to destroy.
    owns_group: bool = True
    # The collective timeout; groups made later (dist.new_group) must be given it, or they get torch's 30 minutes.
    timeout_s: float = 600.0
    # Ranks per tensor-parallel group (--tp): consecutive ranks that split one model replica and share its batches.
    tensor_parallel: int = 1

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def data_parallel_size(self) -> int:
        """Model replicas, each drawing its own batches: the world size, or its tensor-parallel groups."""
        return self.env.world_size // self.tensor_parallel

    @property
    def data_parallel_rank(self) -> int:
        """This rank's replica: which share of the data it draws (the same for a whole tensor-parallel group)."""
        return self.env.rank // self.tensor_parallel

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one process that writes run-wide files."""
        return self.env.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that prepares node-local files."""
        return self.env.local_rank == 0

    @property
    def has_process_group(self) -> bool:
        """Whether this process joined a process group (several ranks, or a group the caller started)."""
        return self.backend is not None


def select_device(env: DistEnv) -> torch.device:
    """One accelerator per local rank where there are accelerators, else the CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        # A process that sees one GPU (Slurm --gpus-per-task, LUMI's per-GCD masks) owns it;
        # seeing several but fewer than the local processes means GPUs are shared.
        if 1 < count < env.local_world_size:
            warnings.warn(
                f"{env.local_world_size} processes on this node share {count} GPUs; "
                f"start one process per GPU ({count} per node)", stacklevel=2,
            )
        device = torch.device("cuda", env.local_rank % count)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def choose_backend(requested: str, device: torch.device) -> str:
    """nccl on CUDA devices, gloo elsewhere, unless the user asked for one."""
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def start(env: DistEnv, backend: str = "auto", timeout_s: float = 600.0, group: bool = True,
          tensor_parallel: int = 1) -> Runtime:
    """Bind this process to its device and, if ``group``, join the process group (``tensor_parallel``: --tp)."""
    device = select_device(env)
    cpu_binding.bind_near_gpu(env.source, env.local_rank, device)  # before the data loaders start their threads
    if not group:
        return Runtime(env, device, None, timeout_s=timeout_s)
    name = choose_backend(backend, device)
    if dist.is_initialized():  # the user's script (or a test) set it up already
        return Runtime(env, device, dist.get_backend(), owns_group=False, timeout_s=timeout_s,
                       tensor_parallel=tensor_parallel)
    # nodescale.init and ranks started by torchrun or srun come here first; `nodescale train` checked already.
    check_backend(name, "backend", "use the backend auto (nccl on CUDA devices, gloo elsewhere) or gloo: "
                  "--backend, or nodescale.init(backend=...)", device.type)
    timeout = timedelta(seconds=timeout_s)
    if env.world_size == 1:
        # An in-process store: a one-rank group needs no port, so none can clash.
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        # Export what env:// and user code read, whatever launcher set us up.
        os.environ["MASTER_ADDR"] = env.master_addr
        os.environ["MASTER_PORT"] = str(env.master_port)
        os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank))
        kwargs: dict[str, object] = {"device_id": device} if name == "nccl" else {}
        store = _job_store(env, timeout)
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = "env://"
        dist.init_process_group(name, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    log.debug("rank %d/%d joined %s group on %s", env.rank, env.world_size, name, device)
    return Runtime(env, device, name, timeout_s=timeout_s, tensor_parallel=tensor_parallel)


def _job_store(env: DistEnv, timeout: timedelta) -> dist.Store | None:
    """The store ``init_process_group("env://")`` would make, its server listening on MASTER_ADDR only.

    None where torch's own ``env://`` path should run instead: under torchrun (its agent
    hosts the store; every rank is a client), when ``NODESCALE_STORE_BIND=any``, or when
    rank 0 cannot bind MASTER_ADDR (torch then binds every interface, as it always does).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or os.environ.get(STORE_BIND_VARIABLE) == "any":
        return None
    if env.rank != 0:
        store: dist.Store | None = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                                                 timeout=timeout)
    else:
        store = rank0_store(env, timeout)
    # init_process_group prefixes the keys of the store it makes for env://, not of one it is given:
    # the same prefix here keeps both kinds of rank (and a server shared with the doctor) in step.
    return dist.PrefixStore("default_pg", store) if store is not None else None


def rank0_store(env: DistEnv, timeout: timedelta, wait_for_workers: bool = True) -> dist.TCPStore | None:
    """Rank 0's store server on MASTER_ADDR:MASTER_PORT, listening on MASTER_ADDR only.

    None where torch should bind it instead (every interface): ``NODESCALE_STORE_BIND=any``,
    a loopback MASTER_ADDR for a job that spans nodes, or an address or port that cannot be
    bound here (the caller's own TCPStore then reports that, or joins a server this process
    already runs on the port: stores are multi-tenant).
    """
    if os.environ.get(STORE_BIND_VARIABLE) == "any":
        return None
    host = bind_address(env.master_addr, whole_job_here=env.local_world_size == env.world_size)
    if host is None:
        return None
    return listening_store(host, env.master_port, env.world_size, timeout, wait_for_workers=wait_for_workers)


def bind_address(master_addr: str, whole_job_here: bool) -> str | None:
    """The address the store should listen on for ``master_addr``; None for every interface.

    A name is resolved as the other ranks would resolve it. A loopback result serves a job
    on several nodes only if the name means something else elsewhere (Debian's ``127.0.1.1``
    line for the host's own name): then only every interface is sure to reach them all.
    """
    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        return None
    address = next((a for a in addresses if ":" not in a), addresses[0])  # IPv4 first, as env.py does
    if ipaddress.ip_address(address.split("%")[0]).is_loopback and not whole_job_here:
        return None
    return address


def listening_store(host: str, port: int, world_size: int | None, timeout: timedelta,
                    wait_for_workers: bool = True) -> dist.TCPStore | None:
    """A multi-tenant ``TCPStore`` server whose socket listens on ``host`` only; None if it cannot bind.

    torch binds its server socket to every interface; given ``master_listen_fd`` it listens
    on that socket instead. Multi-tenant: another ``TCPStore(host, port, is_master=True,
    multi_tenant=True)`` in this process (torch's c10d rendezvous backend) shares the server.
    """
    try:
        sock = listening_socket(host, port)
    except OSError as exc:
        log.debug("could not listen on %s:%d (%s); torch binds the store itself", host, port, exc)
        return None
    bound_port = sock.getsockname()[1]
    # The server owns the descriptor from here on (detach: Python must not close it under it).
    return dist.TCPStore(host, bound_port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=wait_for_workers, multi_tenant=True, master_listen_fd=sock.detach())


def barrier(runtime: Runtime) -> None:
    """Wait for every rank (a no-op without a process group)."""
    if runtime.has_process_group:
        if runtime.backend == "nccl":
            dist.barrier(device_ids=[runtime.device.index])
        else:
            dist.barrier()


def sum_over_replicas(runtime: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (this rank's counts or sums of its samples) summed over the job in place, each sample once.

    The ranks of a tensor-parallel group draw the same batches, so their figures are the same and
    the sum over every rank counts each sample ``tensor_parallel`` times: divided out here.
    """
    if runtime.has_process_group:
        dist.all_reduce(tensor)
        if runtime.tensor_parallel > 1:
            tensor /= runtime.tensor_parallel
    return tensor


def sums_and_maxima(runtime: Runtime, sums: torch.Tensor, maxima: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sums`` as :func:`sum_over_replicas` sums them and ``maxima`` as a MAX all-reduce, in one collective
    (an all-gather of both: a log point of small steps pays one network round trip, not two)."""
    if not runtime.has_process_group:
        return sums, maxima
    mine = torch.cat((sums.reshape(-1), maxima.reshape(-1)))
    everyone = torch.empty(runtime.world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist.all_gather_into_tensor(everyone, mine)
    everyone = everyone.view(runtime.world_size, -1)
    total = everyone[:, :sums.numel()].sum(dim=0) / runtime.tensor_parallel
    return total.view_as(sums), everyone[:, sums.numel():].amax(dim=0).view_as(maxima)


def gather_from_all(runtime: Runtime, value: Any) -> list[Any]:
    """Every rank's ``value`` in rank order (one all-gather of picklable objects); ``[value]`` without a group."""
    if not runtime.has_process_group:
        return [value]
    gathered: list[Any] = [None] * runtime.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def shutdown(runtime: Runtime) -> None:
    """Leave the process group cleanly.

    Callers drop their references to models and optimisers first; collecting
    garbage before the final barrier destroys gloo's pending work objects
    while the group still exists, which is what prevents the exit crash.
    A group the caller's script started is left up for the script to destroy.
    """
    if not runtime.has_process_group or not dist.is_initialized():
        return
    gc.collect()
    barrier(runtime)
    if runtime.owns_group:
        dist.destroy_process_group()
    runtime.backend = None


def abandon(runtime: Runtime) -> None:
    """Leave after a failure: destroy the group (if ours) without a barrier another rank may never reach."""
    if runtime.has_process_group and runtime.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    runtime.backend = None
