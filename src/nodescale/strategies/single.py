"""One process, one device, no process group."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from nodescale.dist.process_group import Runtime


class SingleDevice:
    name = "single"
    needs_process_group = False

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        return model.to(runtime.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        return nullcontext()

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": self.unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
