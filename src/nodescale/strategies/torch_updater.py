"""The optimiser step of the torch-native strategies: autograd, GradScaler, clip_grad_norm_."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn


class TorchUpdater:
    """Backward through a GradScaler (active for fp16 only), clipping, step, zero_grad.

    ``no_sync(model)`` is the strategy's way to skip gradient synchronisation for the
    micro-batches before the last of an accumulation window.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        no_sync: Callable[[nn.Module], AbstractContextManager[None]],
        precision: str,
        grad_clip: float | None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.no_sync = no_sync
        self.grad_clip = grad_clip
        device_type = next(model.parameters()).device.type
        self.scaler = torch.amp.GradScaler(device_type, enabled=precision == "fp16")

    def accumulating(self, closes_window: bool) -> AbstractContextManager[None]:
        return nullcontext() if closes_window else self.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Unscale the gradients (fp16), clip their global norm, return the norm before clipping."""
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: reduced over the shards

    def step(self) -> None:
        if self.grad_clip is not None:
            self.clip_grad_norm(self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])
