"""Activation checkpointing: recompute each repeated block's activations in backward.

Memory for activations drops from one set per block to one per block boundary,
for about one more forward's worth of compute. Uses torch's composable
``checkpoint`` (non-reentrant), which works under DDP and FSDP2 alike; it must be
applied before the strategy wraps the model.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from nodescale.errors import UserError
from nodescale.models.introspect import repeated_blocks


def apply_activation_checkpointing(model: nn.Module, model_name: str) -> int:
    """Checkpoint every repeated block of ``model``; returns how many blocks."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise UserError(
            f"--activation-checkpointing with model {model_name!r}",
            "the model declares no repeated blocks to recompute",
            "use a ResNet or ViT, or drop --activation-checkpointing",
        )
    for block in blocks:
        checkpoint(block)
    return len(blocks)
