"""Optimiser and learning-rate schedule from the configuration."""

from __future__ import annotations

import math

import torch
from torch import nn

from nodescale.config.schema import OptimSection


def make_optimizer(cfg: OptimSection, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The optimiser over ``model``'s trainable parameters.

    On CUDA the fused implementations run the whole update as a few kernels; elsewhere
    torch's defaults apply (the per-tensor loop on CPU), as in a hand-written script.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {}
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **fused)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate before optimiser step ``step`` (0-based).

    Linear warm-up over ``warmup_steps``, then constant or a cosine decay to
    zero at ``total_steps``.
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    cfg: OptimSection, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-optimiser-step schedule; its state is saved with checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.schedule)
    )
