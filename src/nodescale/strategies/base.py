"""What every parallel strategy offers the training loop.

Strategies are siblings (single, dp, ddp, ...), not a hierarchy: each is one
small module holding one class that satisfies this protocol.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from nodescale.dist.process_group import Runtime


class Strategy(Protocol):
    name: str
    needs_process_group: bool

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """The model, on its device, ready for parallel training."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside ``model`` (for state dicts and evaluation)."""

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """Skip gradient synchronisation (micro-batches before the last of an accumulation)."""

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` of the plain model, as ``state_dict()`` gives them.

        A collective for sharded strategies (every rank calls it); only rank 0's result is complete.
        """

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave (on any world size) into ``model`` and ``optimizer``."""


def replicated_state_dict(plain: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state of a model every rank holds whole (single, dp, ddp): its plain ``state_dict()``s."""
    return {"model": plain.state_dict(), "optimizer": optimizer.state_dict()}


def load_replicated_state_dict(plain: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what :func:`replicated_state_dict` gave into a model every rank holds whole."""
    plain.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
