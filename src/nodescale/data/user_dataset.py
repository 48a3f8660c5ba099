"""``--dataset FILE.py:FN``: the user's function returns ``(train, val)``, map-style datasets of ``(input, target)``.

The top level stays free of torch (the launcher calls ``check``); ``load`` imports it.
Samples are converted on the way out, so the user may return numpy arrays or
numbers: inputs become tensors (float64 becomes float32), integer targets int64
class indices, float targets float32 vectors (a scalar becomes a vector of one).
Token sequences, integer inputs of shape (seq_len,) with integer targets of the same
shape (the next tokens), are language modelling.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nodescale.data.base import DatasetSplits
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec
from nodescale.plugins.refs import PluginRef, check_ref

if TYPE_CHECKING:
    import torch

    from nodescale.data.section import DataSection

PAIR_HINT = "return (input, target) from __getitem__, e.g. (image tensor of shape (C, H, W), class index)"


@dataclass(frozen=True)
class PluginFormat:
    """The ``DatasetFormat`` (see ``base``) of a user's dataset function."""

    name: str  # the reference, FILE.py:FN
    needs_dir: bool = False

    def check(self, cfg: DataSection) -> None:
        check_ref("dataset", cfg.name)

    def prepare(self, cfg: DataSection) -> None:
        """Nothing to prepare: the user's function does its own work on every rank."""

    def load(self, cfg: DataSection, seed: int) -> DatasetSplits:
        from nodescale.plugins.calls import call, load_function

        ref, function = load_function("dataset", cfg.name)
        kwargs = dict(cfg.args)
        if "seed" in _parameters(function) and "seed" not in kwargs:
            kwargs["seed"] = seed  # the same on every rank: any split it draws is the same everywhere
        result = call(ref, function, "making the datasets", **kwargs)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise UserError(ref.what, f"returned {_describe(result)}: must return a pair (train, val) of datasets",
                            "end the function with `return train_set, val_set`")
        train, val = (Converted(ref, part, split) for part, split in zip(result, ("train", "val"), strict=True))
        x, y = train[0]
        val[0]  # the same checks on the validation set, now rather than after an epoch
        return DatasetSplits(train, val, derive_spec(x, y, result[0]))


class Converted:
    """The user's dataset with its samples checked and converted to tensors (see the module's docstring)."""

    def __init__(self, ref: PluginRef, dataset: Any, split: str) -> None:
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise UserError(ref.what, f"the {split} set is {_describe(dataset)}: must be a map-style dataset "
                            "(with __len__ and __getitem__)", "return torch.utils.data.Dataset objects, or lists "
                            "of (input, target) pairs")
        self.ref, self.dataset, self.split = ref, dataset, split
        self._length = _checked_length(ref, dataset, split)
        if self._length == 0:
            raise UserError(ref.what, f"the {split} set is empty", "return datasets with at least one sample")

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from nodescale.plugins.calls import call

        sample = call(self.ref, self.dataset.__getitem__, f"reading sample {index} of the {self.split} set", index)
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
            raise UserError(self.ref.what, f"sample {index} of the {self.split} set is {_describe(sample)}: "
                            "must be a pair (input, target)", PAIR_HINT)
        x = self._tensor(sample[0], index, "input")
        return x, self._target(sample[1], index, x)

    def _tensor(self, value: Any, index: int, part: str) -> torch.Tensor:
        import torch

        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise UserError(self.ref.what, f"the {part} of sample {index} of the {self.split} set is "
                            f"{_describe(value)}, which does not convert to a tensor ({exc})",
                            "return tensors, numpy arrays or numbers (images: torchvision's ToTensor)") from None
        return tensor.float() if tensor.dtype == torch.float64 else tensor

    def _target(self, value: Any, index: int, x: torch.Tensor) -> torch.Tensor:
        import torch

        target = self._tensor(value, index, "target")
        if target.is_floating_point():
            return target.float().reshape(1) if target.dim() == 0 else target.float()
        if target.dtype == torch.bool or target.is_complex() or (target.dim() != 0 and not _are_tokens(x, target)):
            raise UserError(self.ref.what, f"the target of sample {index} of the {self.split} set has dtype "
                            f"{target.dtype} and shape {tuple(target.shape)}: must be a class index (an integer), "
                            "float regression targets, or the next token ids (integers of the input's shape "
                            "(seq_len,))", "return one integer class per sample, or floats, or token ids")
        return target.long()


def _checked_length(ref: PluginRef, dataset: Any, split: str) -> int:
    """What the dataset's ``__len__`` returns, refused unless a count (``len()``'s own error shows no user frame)."""
    import operator

    from nodescale.plugins.calls import call, defined_at

    method = type(dataset).__len__
    length = call(ref, method, f"taking the length of the {split} set", dataset)
    try:
        count = operator.index(length)
    except TypeError:
        count = -1
    if count < 0 or isinstance(length, bool):
        where = defined_at(method)
        raise UserError(ref.what, f"the {split} set's __len__ returned {length!r}: must be its number of samples, "
                        "an integer of 0 or more" + (f"\n{where}" if where else ""),
                        f"return the number of samples from {type(dataset).__name__}.__len__")
    return count


def _are_tokens(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``(x, y)`` is a language-modelling sample: integer token ids in and out, both (seq_len,)."""
    return y.dim() == 1 and x.shape == y.shape and not x.is_floating_point() and not x.is_complex()


def derive_spec(x: torch.Tensor, y: torch.Tensor, train: Any) -> InputSpec:
    """The ``InputSpec`` of converted sample ``(x, y)``: classification for an integer target, language modelling
    for integer token ids (``num_classes``: the ``vocab_size`` ``train`` declares, else 0), else regression.

    ``num_classes``: the regression target's size; for classification, what ``train``
    declares (``num_classes``, ``classes``, ``targets``, as torchvision's datasets do),
    else 0 for "unknown" (filled in from the model's output width, or by a scan of the
    labels when a built-in model needs it).
    """
    if y.is_floating_point():
        return InputSpec(tuple(x.shape), y.numel(), "regression")
    if y.dim() == 1:  # token ids (Converted lets no other integer vector through)
        return InputSpec(tuple(x.shape), int(getattr(train, "vocab_size", 0) or 0), "language_modeling")
    return InputSpec(tuple(x.shape), declared_classes(train), "classification")


def declared_classes(dataset: Any) -> int:
    """The number of classes ``dataset`` (or the dataset a ``Subset`` wraps) declares, 0 if none."""
    for candidate in (dataset, getattr(dataset, "dataset", None)):
        count = getattr(candidate, "num_classes", None)
        if isinstance(count, int) and count > 0:
            return count
        classes = getattr(candidate, "classes", None)
        if isinstance(classes, (list, tuple, dict)) and classes:
            return len(classes)
        targets = getattr(candidate, "targets", None)
        if targets is not None and len(targets) > 0:
            import torch

            return int(torch.as_tensor(targets).max()) + 1
    return 0


def _parameters(function: Any) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return set()


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} item{'s' if len(value) != 1 else ''}"
    return f"a {type(value).__name__}"
