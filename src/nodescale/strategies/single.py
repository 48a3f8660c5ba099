"""One process, one device, no process group."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from nodescale.distributed.process_group import Runtime
from nodescale.strategies.base import load_replicated_state_dict, replicated_state_dict
from nodescale.strategies.torch_native import TorchNative


class SingleDevice(TorchNative):
    name = "single"
    needs_process_group = False

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        return model.to(runtime.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        return nullcontext()

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return replicated_state_dict(self.unwrap(model), optimizer)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        load_replicated_state_dict(self.unwrap(model), optimizer, state)
