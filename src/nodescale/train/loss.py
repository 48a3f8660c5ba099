"""Per-sample losses weighted so that padding counts for nothing.

The loss of one rank's micro-batch is ``sum(w_i * l_i) * world_size / N``
where ``N`` is the number of real samples in the whole optimiser step across
all ranks. DDP averages gradients over ranks, so the result is exactly the
gradient of the mean loss over the real samples of the global batch, however
unevenly the last batch of an epoch is filled. That weighting is why every
loss here, the user's own included (``--loss FILE.py:FN``), gives one value per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from nodescale.errors import UserError
from nodescale.models.spec import Task

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, target) -> losses of shape (batch,)


def per_sample_loss(output: torch.Tensor, target: torch.Tensor, task: Task) -> torch.Tensor:
    """Cross-entropy per sample for classification, mean squared error per sample for regression.

    Language modelling: the mean cross-entropy over the window's next-token predictions
    (``output`` of shape (batch, tokens, vocabulary)). Every window has the same length,
    so the mean over samples is the mean over tokens, and padding weights work as ever.
    """
    if task == "regression":
        return F.mse_loss(output.float(), target.float(), reduction="none").flatten(1).mean(dim=1)
    if task == "language_modeling":
        # One row per token: the log-softmax runs along the contiguous vocabulary. The (batch, vocabulary,
        # tokens) layout takes a strided kernel, 3.8x slower with GPT-2's vocabulary (benchmarks/RESULTS.md).
        tokens = _cross_entropy(output.flatten(0, 1), target.flatten())
        return tokens.view(target.shape).mean(dim=1)
    return _cross_entropy(output, target)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy, computed in fp32 whatever the logits' precision.

    bf16/fp16 logits go in as they are, under autocast, whose log-softmax reads them and writes fp32:
    a ``.float()`` copy first made the softmax and its backward 1.6x slower (GPT-2 small's 50k vocabulary,
    32 x 1024 tokens on an H100: 27.8 against 17.7 ms, 13% of the step; benchmarks/RESULTS.md).
    """
    if logits.dtype in (torch.bfloat16, torch.float16) and logits.device.type in ("cuda", "cpu"):
        with torch.autocast(logits.device.type, dtype=logits.dtype):
            return F.cross_entropy(logits, target, reduction="none")
    return F.cross_entropy(logits.float(), target, reduction="none")


def correct(output: torch.Tensor, target: torch.Tensor, task: Task) -> torch.Tensor | None:
    """1.0 where the predicted class is right, per sample (``None`` for regression); for language
    modelling the share of the window's next tokens predicted right."""
    if task == "regression":
        return None
    if task == "language_modeling":
        return (output.argmax(dim=-1) == target).float().mean(dim=1)
    return (output.argmax(dim=1) == target).float()


def model_output(output: Any) -> torch.Tensor:
    """The predictions in what a model's forward returned.

    A tensor as it is; Hugging Face style outputs by their logits (an object with
    ``.logits``, a dict with ``"logits"``); a tuple by its first item. A ``loss``
    the model computed itself is not used: nodescale needs per-sample losses to
    weight padding, so it computes them from the logits (``--loss``).
    """
    if isinstance(output, torch.Tensor):  # the built-in models: one check per step
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if isinstance(logits, torch.Tensor):
        return logits
    keys = f" with keys {', '.join(map(str, output))}" if isinstance(output, Mapping) else ""
    raise UserError(
        f"model output of type {type(output).__name__}{keys}",
        "must be a tensor, an object with .logits, a dict with 'logits', or a tuple whose first item is a tensor",
        "return the logits from forward (a loss the model computes itself is not used: nodescale computes "
        "per-sample losses from the logits, see --loss)",
    )


def make_loss(name: str, task: Task) -> LossFn:
    """The per-sample loss ``train.loss`` names: auto (by task), cross_entropy, mse, or the user's function."""
    if name == "auto":
        return partial(per_sample_loss, task=task)
    if name == "cross_entropy":  # over classes, or over each next token
        return partial(per_sample_loss, task="language_modeling" if task == "language_modeling" else "classification")
    if name == "mse":
        return partial(per_sample_loss, task="regression")
    from nodescale.plugins.calls import load_function

    ref, function = load_function("loss", name)
    return partial(_checked_user_loss, ref, function)


def _checked_user_loss(ref: Any, function: Callable[..., Any], output: torch.Tensor,
                       target: torch.Tensor) -> torch.Tensor:
    """The user's loss, refused unless it gives one loss per sample (a shape check: no device sync)."""
    from nodescale.plugins.calls import call

    losses = call(ref, function, "computing the loss", output, target)
    batch = output.shape[0]
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (batch,):
        got = f"a tensor of shape {tuple(losses.shape)}" if isinstance(losses, torch.Tensor) else \
            f"a {type(losses).__name__}"
        raise UserError(ref.what, f"returned {got} for a batch of {batch}: must be one loss per sample, "
                        f"shape ({batch},)",
                        "compute it with reduction='none', e.g. F.cross_entropy(output, target, reduction='none'); "
                        "nodescale weights the samples (padding counts 0) and averages over the real ones")
    return losses
