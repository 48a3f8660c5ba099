"""Build a run's model and check it against the data: the model, its weights, one probe forward.

Every rank runs the same checks on the same samples and so raises the same
``UserError`` (the launcher prints it once, exit code 2): a model function that
fails or returns something else, inputs the model refuses, labels beyond its
outputs, a loss that does not give one value per sample.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nodescale.errors import UserError
from nodescale.models.registry import build_model
from nodescale.models.spec import InputSpec
from nodescale.plugins.calls import describe_exception, source_file
from nodescale.plugins.refs import is_plugin, parse_ref
from nodescale.train.loss import LossFn, make_loss, model_output

if TYPE_CHECKING:
    from nodescale.config.schema import RunConfig
    from nodescale.data.base import DatasetSplits


def build_for_run(cfg: RunConfig, splits: DatasetSplits) -> tuple[nn.Module, InputSpec]:
    """The run's model (weights loaded, not yet wrapped) and the spec of its samples.

    Built-in models on built-in data are built as always; with any of the user's
    model, data or loss, two training samples go through the model first.
    """
    spec = splits.spec
    user_model = is_plugin(cfg.model.name)
    if not user_model and spec.task == "classification" and spec.num_classes == 0:
        spec = replace(spec, num_classes=_count_classes(splits.train))
    model = build_model(cfg.model, spec)
    if cfg.model.weights is not None:
        load_weights(model, cfg.model.weights)
    if user_model or is_plugin(cfg.data.name) or is_plugin(cfg.train.loss):
        spec = probe(model, splits, spec, make_loss(cfg.train.loss, spec.task), cfg)
    return model, spec


def load_weights(model: nn.Module, path: Path) -> None:
    """Load the state dict in ``path`` (or a nodescale full checkpoint's model) into ``model``, strictly."""
    what = f"model.weights {str(path)!r}"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unreadable file: say why
        raise UserError(what, f"does not load ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                        "save it with torch.save(model.state_dict(), PATH)") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a checkpoint file of a nodescale run
    try:
        model.load_state_dict(state)
    except (RuntimeError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(what, f"does not fit the model ({str(exc).strip().splitlines()[0]})",
                        "load the state dict of this same model, built with the same model.args") from None


def probe(model: nn.Module, splits: DatasetSplits, spec: InputSpec, loss: LossFn, cfg: RunConfig) -> InputSpec:
    """One forward of two training samples: the model takes them, labels fit its outputs, the loss is per sample.

    In eval mode without gradients, so the model's weights and statistics stay as built.
    Returns ``spec`` with a user model's classifier width as ``num_classes``.
    """
    count = min(2, len(splits.train))
    x, y = _stack([splits.train[i] for i in range(count)])
    parameter = next(model.parameters(), None)
    if parameter is not None and parameter.device.type != "meta":  # a model the user's function moved
        x, y = x.to(parameter.device), y.to(parameter.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            raw = model(x)
    except Exception as exc:  # the model refused the inputs: name their shape, show the user's frames
        what = f"inputs of shape {tuple(x.shape[1:])} (a batch of {count}: {tuple(x.shape)}, {x.dtype})"
        hint = "make the dataset's inputs what the model's forward takes, or change the model"
        path = source_file(parse_ref("model", cfg.model.name)) if is_plugin(cfg.model.name) else None
        rule = describe_exception(exc, path, "in its forward on the dataset's first samples")
        raise UserError(what, f"model {cfg.model.name!r} refused them: {rule}", hint) from None
    finally:
        model.train(was_training)
    output = model_output(raw)
    if output.dim() == 0 or output.shape[0] != count:
        raise UserError(f"model output of shape {tuple(output.shape)} for a batch of {count}",
                        "must have the batch as its first dimension", "return one row of outputs per sample")
    default_loss = cfg.train.loss in ("auto", "cross_entropy", "mse")
    if spec.task == "classification" and default_loss:
        spec = _check_classes(output, splits, spec, cfg)
    elif spec.task == "language_modeling" and default_loss:
        spec = _check_tokens(output, y, spec)
    elif spec.task == "regression" and default_loss and output.shape[1:] != y.shape[1:]:
        raise UserError(f"model output of shape {tuple(output.shape[1:])} per sample",
                        f"does not match the regression targets' shape {tuple(y.shape[1:])}",
                        "make the model's last layer give one output per target value")
    elif spec.task == "language_modeling" and default_loss and (
            output.dim() != 3 or output.shape[1] != y.shape[1] or output.shape[2] < spec.num_classes):
        raise UserError(f"model output of shape {tuple(output.shape[1:])} per window of {y.shape[1]} tokens",
                        f"must be (tokens, vocabulary): next-token logits over at least {spec.num_classes} ids",
                        "return logits of shape (batch, seq_len, vocabulary) from forward")
    loss(output.float(), y)  # the user's loss checks its own shape (one value per sample)
    return spec


def _check_classes(output: torch.Tensor, splits: DatasetSplits, spec: InputSpec, cfg: RunConfig) -> InputSpec:
    """Labels of the first batch (and of a declared ``targets`` list) within the model's outputs."""
    if output.dim() != 2:
        raise UserError(f"model output of shape {tuple(output.shape)} for integer class targets",
                        "a classifier's output must be (batch, classes)",
                        "return logits of shape (batch, classes), or give float targets for regression")
    width = output.shape[1]
    first = min(cfg.train.batch_size, len(splits.train))
    labels = torch.stack([splits.train[i][1] for i in range(first)])
    declared = getattr(getattr(splits.train, "dataset", None), "targets", None)
    if declared is not None and len(declared) > 0:
        labels = torch.cat([labels, torch.as_tensor(declared).long().flatten()])
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= width:
        bad = low if low < 0 else high
        raise UserError(f"label {bad} in the training set", f"is out of range for the model's {width} outputs "
                        f"(classes 0..{width - 1})",
                        f"give the model one output per class (at least {high + 1}), or number the classes from 0")
    return replace(spec, num_classes=width) if is_plugin(cfg.model.name) else spec


def _check_tokens(output: torch.Tensor, y: torch.Tensor, spec: InputSpec) -> InputSpec:
    """Logits (batch, seq_len, vocab) for next-token targets (batch, seq_len), the targets within the vocabulary."""
    if output.dim() != 3 or output.shape[:2] != y.shape:
        raise UserError(f"model output of shape {tuple(output.shape)} for token targets of shape {tuple(y.shape)}",
                        "a language model's output must be logits (batch, seq_len, vocab)",
                        "return the logits of every position")
    vocab, high = output.shape[2], int(y.max())
    if high >= vocab or int(y.min()) < 0:
        raise UserError(f"token id {high if high >= vocab else int(y.min())} in the training targets",
                        f"is outside the model's vocabulary of {vocab} (ids 0..{vocab - 1})",
                        "tokenise with the model's own tokenizer, or give the model a larger vocabulary")
    return replace(spec, num_classes=vocab)


def _count_classes(train: Any) -> int:
    """Max label + 1 over every training sample: one pass over the data, for a built-in model's classifier."""
    return max(int(train[i][1]) for i in range(len(train))) + 1


def _stack(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
    except RuntimeError:
        shapes = ", ".join(f"{tuple(s[0].shape)} and target {tuple(s[1].shape)}" for s in samples)
        raise UserError(f"samples of shapes {shapes}", "every sample must have the same shapes: batches are stacked",
                        "resize or pad the inputs in the dataset") from None
