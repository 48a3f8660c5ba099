"""Validation over the whole validation set, with every rank taking part.

Each rank evaluates its shard (padded to equal batch counts with weight-0
samples, so sharded models whose forward is a collective never hang), sums
loss, correct predictions and sample counts on the device, and one
all-reduce makes the totals global. The result is the accuracy over every
validation sample exactly once, not over rank 0's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nodescale.data.loader import StepLoader
from nodescale.models.spec import Task
from nodescale.train.loss import LossFn, correct, model_output, per_sample_loss


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float | None  # None for regression
    samples: int


def evaluate(
    model: nn.Module, loader: StepLoader, task: Task, autocast: torch.autocast, distributed: bool,
    loss: LossFn | None = None,
) -> EvalResult:
    """Loss and accuracy of ``model`` over the loader's whole dataset, reduced over ranks.

    ``loss``: the run's per-sample loss (default: the task's, as :func:`per_sample_loss` picks).
    """
    device = loader.device
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in loader.epoch(0):
            with autocast:
                output = model_output(model(batch.x))
            losses = loss(output, batch.y) if loss is not None else per_sample_loss(output, batch.y, task)
            totals[0] += (losses * batch.weights).sum()
            hits = correct(output, batch.y, task)
            if hits is not None:
                totals[1] += (hits * batch.weights).sum()
            totals[2] += batch.weights.sum()
    model.train(was_training)
    if distributed:
        dist.all_reduce(totals)
    loss_sum, hits_sum, count = totals.tolist()
    count = max(count, 1.0)
    accuracy = None if task == "regression" else hits_sum / count
    return EvalResult(loss_sum / count, accuracy, int(count))
