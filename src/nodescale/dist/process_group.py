"""Process-group start-up and clean shutdown, and the device each rank uses.

One ``Runtime`` per process says who it is (``DistEnv``), which device it
drives and whether a process group is up. Start-up binds one device per local
rank; shutdown follows the sequence that avoids gloo's crash at interpreter
exit (a work object destroyed during teardown aborts ~30% of runs otherwise).
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nodescale.dist.env import DistEnv

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """Who this process is, the device it drives and its collective backend."""

    env: DistEnv
    device: torch.device
    backend: str | None  # None when no process group was started

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one process that writes run-wide files."""
        return self.env.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node that prepares node-local files."""
        return self.env.local_rank == 0

    @property
    def distributed(self) -> bool:
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


def start(env: DistEnv, backend: str = "auto", timeout_s: float = 600.0, group: bool = True) -> Runtime:
    """Bind this process to its device and, if ``group``, join the process group."""
    device = select_device(env)
    if not group:
        return Runtime(env, device, None)
    name = choose_backend(backend, device)
    if dist.is_initialized():  # the user's script (or a test) set it up already
        return Runtime(env, device, dist.get_backend())
    timeout = timedelta(seconds=timeout_s)
    if env.world_size == 1:
        # An in-process store: a one-rank group needs no port, so none can clash.
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        # Export what env:// and user code read, whatever launcher set us up.
        os.environ["MASTER_ADDR"] = env.master_addr
        os.environ["MASTER_PORT"] = str(env.master_port)
        os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank))
        kwargs = {"device_id": device} if name == "nccl" else {}
        dist.init_process_group(
            name, init_method="env://", rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs
        )
    log.debug("rank %d/%d joined %s group on %s", env.rank, env.world_size, name, device)
    return Runtime(env, device, name)


def barrier(runtime: Runtime) -> None:
    """Wait for every rank (a no-op without a process group)."""
    if runtime.distributed:
        if runtime.backend == "nccl":
            dist.barrier(device_ids=[runtime.device.index])
        else:
            dist.barrier()


def shutdown(runtime: Runtime) -> None:
    """Leave the process group cleanly.

    Callers drop their references to models and optimisers first; collecting
    garbage before the final barrier destroys gloo's pending work objects
    while the group still exists, which is what prevents the exit crash.
    """
    if not runtime.distributed or not dist.is_initialized():
        return
    gc.collect()
    barrier(runtime)
    dist.destroy_process_group()
    runtime.backend = None
