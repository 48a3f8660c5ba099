"""Per-sample losses weighted so that padding counts for nothing.

The loss of one rank's micro-batch is ``sum(w_i * l_i) * world_size / N``
where ``N`` is the number of real samples in the whole optimiser step across
all ranks. DDP averages gradients over ranks, so the result is exactly the
gradient of the mean loss over the real samples of the global batch, however
unevenly the last batch of an epoch is filled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nodescale.models.spec import Task


def per_sample_loss(output: torch.Tensor, target: torch.Tensor, task: Task) -> torch.Tensor:
    """Cross-entropy per sample for classification, mean squared error per sample for regression."""
    if task == "regression":
        return F.mse_loss(output.float(), target.float(), reduction="none").flatten(1).mean(dim=1)
    return F.cross_entropy(output.float(), target, reduction="none")


def correct(output: torch.Tensor, target: torch.Tensor, task: Task) -> torch.Tensor | None:
    """1.0 where the predicted class is right (``None`` for regression)."""
    if task == "regression":
        return None
    return (output.argmax(dim=1) == target).float()
