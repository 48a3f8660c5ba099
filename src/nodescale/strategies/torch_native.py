"""What the torch-native strategies (single, dp, ddp, fsdp) share, as one mixin.

They differ in how they wrap the model, skip synchronisation and gather state;
they take the optimiser step, write sharded checkpoints and count their memory
the same way. The mixin needs ``unwrap`` and ``no_sync`` from the class using it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn

from nodescale.config.schema import RunConfig
from nodescale.strategies.base import Footprint
from nodescale.strategies.footprint import tensor_footprint
from nodescale.strategies.torch_updater import TorchUpdater


class TorchNative:
    sharded_layout = "torch-dcp"

    def unwrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        raise NotImplementedError

    def make_updater(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: RunConfig) -> TorchUpdater:
        return TorchUpdater(model, optimizer, self.no_sync, cfg.train.precision, cfg.optim.grad_clip)

    def save_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        from nodescale.strategies.dcp_state import save_dcp  # torch.distributed.checkpoint: ~0.1-1 s to import

        save_dcp(self.unwrap(model), optimizer, directory)

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        from nodescale.strategies.dcp_state import load_dcp

        load_dcp(self.unwrap(model), optimizer, directory)

    def footprint(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Footprint:
        return tensor_footprint(self.unwrap(model), optimizer)
