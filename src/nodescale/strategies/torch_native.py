"""What the torch-native strategies (single, dp, ddp, fsdp) share, as one mixin.

They differ in how they wrap the model and skip synchronisation; they take the
optimiser step, write sharded checkpoints and count their memory the same way.
Their full state dicts are the plain model's and optimiser's own: every rank
holds them whole (FSDP, which shards them, gathers its own instead).
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nodescale.config.schema import RunConfig
from nodescale.config.strategy import StrategySection
from nodescale.models.introspect import unwrap
from nodescale.strategies.base import Footprint
from nodescale.strategies.footprint import tensor_footprint
from nodescale.strategies.torch_updater import TorchUpdater


class TorchNative:
    sharded_layout = "torch-dcp"
    shards_state = False

    def __init__(self, cfg: StrategySection, precision: str = "fp32") -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.precision = precision  # the run's (FSDP's mixed-precision policy follows it)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """Skip gradient synchronisation inside (nothing to skip in one process)."""
        return nullcontext()

    def make_updater(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig) -> TorchUpdater:
        return TorchUpdater(model, optimizer, self.no_sync, cfg.train.precision, cfg.optim.grad_clip)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def save_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        from nodescale.strategies.dcp_state import save_dcp  # torch.distributed.checkpoint: ~0.1-1 s to import

        save_dcp(unwrap(model), optimizer, directory)

    def save_sharded_async(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                           group: Any) -> Future:
        from nodescale.strategies.dcp_state import async_save_dcp

        return async_save_dcp(unwrap(model), optimizer, directory, group)

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        from nodescale.strategies.dcp_state import load_dcp

        load_dcp(unwrap(model), optimizer, directory)

    def footprint(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Footprint:
        return tensor_footprint(unwrap(model), optimizer)
