"""``--model FILE.py:FN``: the user's function returns the ``nn.Module`` to train."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from nodescale.errors import UserError
from nodescale.plugins.calls import call, defined_at, load_function

if TYPE_CHECKING:
    from nodescale.models.section import ModelSection


def build_user_model(cfg: ModelSection) -> nn.Module:
    """The ``nn.Module`` the user's function ``cfg.name`` returns, called with ``cfg.args``."""
    ref, function = load_function("model", cfg.name)
    model = call(ref, function, "building the model", **cfg.args)
    if not isinstance(model, nn.Module):
        kind = f"the class {model.__name__}" if isinstance(model, type) else f"a {type(model).__name__}"
        raise UserError(ref.what, f"returned {kind}: must return a torch.nn.Module",
                        f"return the model itself from {ref.function}(), e.g. `return MyNet(width)`")
    if not any(parameter.requires_grad for parameter in model.parameters()):  # the optimiser would refuse it
        where = defined_at(function)
        raise UserError(ref.what, f"returned a {type(model).__name__} without trainable parameters: nothing to "
                        "train" + (f"\n{where}" if where else ""),
                        "give the model layers with weights (nn.Linear, nn.Conv2d, ...), or leave some of them "
                        "with requires_grad=True")
    return model
