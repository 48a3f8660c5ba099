"""A handful of calls that make a single-GPU script distributed.

::

    import nodescale

    ctx = nodescale.init()                       # rank, device, process group
    model, optimizer = ctx.prepare(model, optimizer)
    loader = ctx.loader(dataset, batch_size=64)  # a new shuffle every epoch
    for epoch in range(epochs):
        for x, y in loader:
            x, y = x.to(ctx.device), y.to(ctx.device)
            ...
        ctx.print(f"epoch {epoch}: loss {ctx.mean(loss):.4f}")
        ctx.save("checkpoint.pt", {"model": ctx.unwrap(model).state_dict(), "epoch": epoch})
    ctx.close()

The script runs unchanged as ``python script.py`` (one process), under
``torchrun``, ``srun`` or ``mpiexec``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from nodescale.atomic_files import write_atomic
from nodescale.dist.env import DistEnv, detect
from nodescale.dist.process_group import Runtime, abandon, barrier, shutdown, start
from nodescale.dist.sync_batchnorm import convert_sync_batchnorm


def init(*, backend: str = "auto", seed: int | None = None, timeout_s: float = 600.0) -> Context:
    """Join the job this process belongs to and bind it to its device.

    Detects torchrun, Slurm, PBS/PALS, Open MPI and MPICH launches (a plain
    ``python script.py`` is a job of one). ``seed`` seeds torch identically
    on every rank, so models built next start from the same weights.
    """
    env = detect()
    runtime = start(env, backend, timeout_s, group=env.world_size > 1)
    if seed is not None:
        torch.manual_seed(seed)
    return Context(runtime)


class Context:
    """This process's place in the job, and the calls that depend on it."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def __enter__(self) -> Context:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # other ranks may never reach a barrier now; leave without one
            abandon(self.runtime)

    @property
    def env(self) -> DistEnv:
        return self.runtime.env

    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def local_rank(self) -> int:
        return self.runtime.env.local_rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def is_main(self) -> bool:
        return self.runtime.is_main

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        sync_batchnorm: bool = False,
        **ddp_options: Any,
    ) -> Any:
        """The model on this rank's device, wrapped in DDP when there are several ranks.

        Returns ``model`` alone, or ``(model, optimizer)`` when an optimiser is
        given. The optimiser may be created before or after: parameters keep
        their identity through the move and the BatchNorm conversion.
        """
        if sync_batchnorm and self.world_size > 1:
            model = convert_sync_batchnorm(model, self.device.type)
        model = model.to(self.device)
        if self.world_size > 1:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **ddp_options)
        return model if optimizer is None else (model, optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside a DDP wrapper (for ``state_dict`` and export)."""
        return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    def loader(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        pad: bool = True,
        seed: int = 0,
        **loader_options: Any,
    ) -> EpochLoader:
        """A DataLoader over this rank's shard, reshuffled every epoch (``set_epoch`` done for you).

        ``batch_size`` is per process. For training, the sampler pads the last
        round with repeated samples (or drops it, with ``drop_last``) so every
        rank runs the same number of steps, as DDP needs. For evaluation pass
        ``pad=False``: each sample then lands on exactly one rank, so totals
        summed over ranks count every sample once (ranks may differ by one
        sample, so evaluate the unwrapped model: ``ctx.unwrap(model)``).
        """
        sampler: DistributedSampler | _UnpaddedShard
        if pad:
            sampler = DistributedSampler(
                dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=seed,
                drop_last=drop_last,
            )
        else:
            sampler = _UnpaddedShard(len(dataset), self.world_size, self.rank, shuffle, seed)
        loader_options.setdefault("pin_memory", self.device.type == "cuda")
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_options)
        return EpochLoader(loader, sampler)

    def mean(self, value: float | torch.Tensor) -> float:
        """The mean of ``value`` over all ranks (a collective: every rank must call it)."""
        tensor = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach().clone()
        if self.runtime.distributed:
            dist.all_reduce(tensor)
            tensor /= self.world_size
        return float(tensor)

    def sum(self, value: float | torch.Tensor) -> float:
        """The sum of ``value`` over all ranks (a collective)."""
        tensor = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach().clone()
        if self.runtime.distributed:
            dist.all_reduce(tensor)
        return float(tensor)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        barrier(self.runtime)

    def save(self, path: str | Path, obj: Any) -> None:
        """``torch.save`` from rank 0 only, atomically; every rank waits until it is written."""
        if self.is_main:
            write_atomic(Path(path), lambda handle: torch.save(obj, handle))
        self.barrier()

    def load(self, path: str | Path, *, weights_only: bool = True) -> Any:
        """``torch.load`` onto this rank's device."""
        return torch.load(path, map_location=self.device, weights_only=weights_only)

    def close(self) -> None:
        """Leave the process group cleanly (drop references to models first)."""
        shutdown(self.runtime)


class _UnpaddedShard:
    """Positions ``rank, rank + W, ...`` of the (shuffled) order: each sample on exactly one rank."""

    def __init__(self, size: int, world_size: int, rank: int, shuffle: bool, seed: int) -> None:
        self.size, self.world_size, self.rank, self.shuffle, self.seed = size, world_size, rank, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.size))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        return iter(order[self.rank::self.world_size])

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))


class EpochLoader:
    """Iterating starts the next epoch: the sampler is told the epoch each time."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler | _UnpaddedShard) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Start from ``epoch`` (after resuming from a checkpoint)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)
