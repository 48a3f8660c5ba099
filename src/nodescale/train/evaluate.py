"""Validation over the whole validation set, with every rank taking part.

Each rank evaluates its shard from a padded ``ctx.loader`` (a rank a whole batch short gets
one padding sample, so sharded models whose forward is a collective never hang) and counts
only the real samples; ``ctx.sum`` makes the totals global. The result is the loss and
accuracy over every validation sample exactly once, not over rank 0's shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nodescale.data.epoch_loader import EpochLoader
from nodescale.engine.summary import EvalResult
from nodescale.models.spec import Task
from nodescale.train.loss import LossFn, correct, model_output

if TYPE_CHECKING:
    from nodescale.api import Context


def evaluate(ctx: Context, model: nn.Module, loader: EpochLoader, loss: LossFn, task: Task) -> EvalResult:
    """Loss and accuracy of ``model`` over the loader's whole dataset (every rank; untimed)."""
    loss_sum = hits = torch.zeros((), dtype=torch.float64, device=ctx.device)
    count = 0
    was_training = model.training
    model.eval()
    with ctx.untimed(), torch.no_grad():
        for x, y in loader:
            real = loader.real_count  # the real samples come first; a padding batch has none
            with ctx.autocast():
                output = model_output(model(x))
            loss_sum = loss_sum + loss(output, y)[:real].sum()
            right = correct(output, y, task)
            if right is not None:
                hits = hits + right[:real].sum()
            count += real
        # Inside the untimed block: a rank that finished first waits here for the others.
        total = max(ctx.sum(count), 1.0)
        accuracy = None if task == "regression" else ctx.sum(hits) / total
        loss_mean = ctx.sum(loss_sum) / total
    model.train(was_training)
    return EvalResult(loss_mean, accuracy, int(total))
