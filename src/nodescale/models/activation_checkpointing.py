"""Activation checkpointing: recompute each repeated block's activations in backward.

Memory for activations drops from one set per block to one per block boundary,
for about one more forward's worth of compute. Uses torch's composable
``checkpoint`` (non-reentrant), which works under DDP and FSDP2 alike; it must be
applied before the strategy wraps the model.

The recomputation is a second forward in training mode: left alone, BatchNorm
would fold every batch into its running statistics twice (the weights come out
right, evaluation does not). During recomputation the blocks' BatchNorm layers
use the batch statistics without updating the running ones, as in the first pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

from torch import nn
from torch.distributed._composable import checkpoint

from nodescale.errors import UserError
from nodescale.models.introspect import repeated_blocks


def apply_activation_checkpointing(model: nn.Module, model_name: str, unit_names: Sequence[str] = ()) -> int:
    """Checkpoint every repeated block of ``model`` (``unit_names``: class names that win); returns how many."""
    blocks = repeated_blocks(model, unit_names)
    if not blocks:
        raise UserError(
            f"--activation-checkpointing with model {model_name!r}",
            "no repeated blocks to recompute: the model declares no block_types, has no Hugging Face "
            "_no_split_modules and no nn.ModuleList",
            "name its block class: --set strategy.fsdp_units=MyBlock, or drop --activation-checkpointing",
        )
    for block in blocks:
        checkpoint(block, context_fn=_contexts_for(block))
    return len(blocks)


def _contexts_for(block: nn.Module):  # noqa: ANN202 (torch's context_fn type is private)
    return lambda: (nullcontext(), _running_statistics_frozen(block))


@contextmanager
def _running_statistics_frozen(block: nn.Module) -> Iterator[None]:
    """BatchNorm in ``block`` normalises with batch statistics and leaves its running ones as they were.

    Momentum 0 makes the update ``running * 1 + batch * 0``, the same values bit for bit, and
    keeps the call (and so the tensors saved for backward) identical to the first pass, which
    checkpointing verifies. The batch count, which that update still advances, is put back.
    """
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(norm.momentum, norm.num_batches_tracked.clone()) for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, count) in zip(norms, saved, strict=True):
            norm.momentum = momentum
            norm.num_batches_tracked.copy_(count)
