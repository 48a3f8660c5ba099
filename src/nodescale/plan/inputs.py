"""The samples a plan is for: their shape and how many, from the dataset or from flags.

``--sample-shape`` and ``--train-samples`` spare loading the dataset (which may be large, or
not on this machine); without them the dataset is loaded as ``train`` loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nodescale.errors import UserError
from nodescale.models.spec import InputSpec

if TYPE_CHECKING:
    from nodescale.config.schema import RunConfig

DEFAULT_CLASSES = 1000  # classification heads sized for ImageNet when only the shape is given
DEFAULT_VOCAB = 50257  # GPT-2's vocabulary, for language models given only a window length


def parse_sample_shape(text: str) -> tuple[int, ...]:
    """``"3,224,224"`` -> ``(3, 224, 224)``; ``"1024"`` -> ``(1024,)`` (a token window)."""
    parts = [part.strip() for part in str(text).split(",")]
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts) or len(parts) > 4:
        raise UserError(f"--sample-shape {text!r}", "must be 1 to 4 whole numbers above 0, comma-separated",
                        "e.g. --sample-shape 3,224,224 for images, --sample-shape 1024 for token windows")
    return tuple(int(part) for part in parts)


def sample_spec(cfg: RunConfig, shape: tuple[int, ...] | None, num_classes: int | None) -> InputSpec | None:
    """The spec from ``--sample-shape`` (None: none given, read the dataset)."""
    if shape is None:
        return None
    from nodescale.models.registry import model_entry
    from nodescale.plugins.refs import is_plugin

    task = "classification" if is_plugin(cfg.model.name) else model_entry(cfg.model.name).task
    if task == "language_modeling":
        return InputSpec(shape, num_classes or DEFAULT_VOCAB, "language_modeling")
    if task == "regression":
        return InputSpec(shape, num_classes or 1, "regression")
    return InputSpec(shape, num_classes or DEFAULT_CLASSES, "classification")


def dataset_facts(cfg: RunConfig) -> tuple[InputSpec, int]:
    """The spec of ``cfg``'s dataset and its number of training samples, by loading it."""
    from dataclasses import replace

    from nodescale.data.registry import get_format
    from nodescale.train.build_model import _count_classes

    data_format = get_format(cfg.data.name)
    data_format.check(cfg.data)
    data_format.prepare(cfg.data)
    splits = data_format.load(cfg.data, cfg.train.seed)
    spec = splits.spec
    if spec.task == "classification" and spec.num_classes == 0:
        spec = replace(spec, num_classes=_count_classes(splits.train))
    return spec, len(splits.train)  # type: ignore[arg-type]
