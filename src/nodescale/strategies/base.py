"""What every parallel strategy offers the training loop.

Strategies are siblings (single, dp, ddp, fsdp, deepspeed), not a hierarchy:
each is one small module holding one class that satisfies this protocol. What the
torch-native ones share (the optimiser step, full state dicts,
``torch.distributed.checkpoint`` save and load, the tensor footprint) comes from
the ``TorchNative`` mixin; DeepSpeed brings its own engine for all of it. The plain
model inside any strategy's wrapper is ``models.introspect.unwrap``'s.
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from nodescale.config.schema import RunConfig
from nodescale.distributed.process_group import Runtime


@dataclass(frozen=True)
class Footprint:
    """Bytes this rank holds for the training state (what sharding divides), by kind."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int  # optimiser state, including any fp32 master copy of the parameters

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


class Updater(Protocol):
    """How a micro-batch's loss becomes an optimiser step: accumulation, scaling, clipping."""

    model: nn.Module  # what forward runs through (the strategy's wrapper, or DeepSpeed's engine)

    def accumulating(self, closes_window: bool) -> AbstractContextManager[None]:
        """Context around forward and backward of one micro-batch.

        ``closes_window``: the micro-batch is the last of its accumulation window, so its
        backward must synchronise gradients; the others may skip that.
        """

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``, already normalised over the whole accumulation window."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor | None:
        """Clip the gradients' global norm now (or in the step); the norm before clipping, where known."""

    def step(self) -> None:
        """Clip, take the optimiser step, and clear the gradients (once per window)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of the updater (the fp16 loss scale)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave."""


class Strategy(Protocol):
    name: str  # its section's (which says the rest: whether it needs a process group, its options)
    sharded_layout: str  # what save_sharded writes: "torch-dcp" or "deepspeed"
    shards_state: bool  # checkpoint.format auto: every rank writes its shards (FSDP, DeepSpeed)

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """The model, on its device, ready for parallel training."""

    def make_updater(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig) -> Updater:
        """The updater for the wrapped ``model`` and its ``optimizer``; its ``model`` is what to train."""

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` of the plain model, as ``state_dict()`` gives them.

        A collective for sharded strategies (every rank calls it); only rank 0's result is complete.
        """

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave (on any world size) into ``model`` and ``optimizer``."""

    def save_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Every rank writes its part of the model and optimiser state into ``directory`` (a collective)."""

    def save_sharded_async(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                           group: Any) -> Future:
        """:meth:`save_sharded` that returns once the state is staged in host memory (torch-native strategies only:
        ``--checkpoint-async`` refuses DeepSpeed); the future is done when this rank's files are on disk."""

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Every rank reads its part of what :meth:`save_sharded` wrote, on any world size it supports."""

    def footprint(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Footprint:
        """The bytes of parameters, gradients and optimiser state this rank holds now."""

