"""An optimiser made before the strategy wrapped its model, pointed at the parameters that now train."""

from __future__ import annotations

import torch
from torch import nn

from nodescale.errors import UserError


def rebind_parameters(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module) -> None:
    """Point ``optimizer`` at the parameters the strategy made (FSDP2 replaces them with sharded ones)."""
    now = dict(model.named_parameters())
    for group in optimizer.param_groups:
        rebound = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise UserError("ctx.prepare(model, optimizer)", "the optimiser holds a parameter the model does not",
                                "build the optimiser from model.parameters()")
            rebound.append(now[name])
        group["params"] = rebound
