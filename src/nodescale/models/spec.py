"""What a dataset tells a model about its samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Task = Literal["classification", "regression", "language_modeling"]


@dataclass(frozen=True)
class InputSpec:
    """Shape of one input sample and what is predicted from it.

    ``shape`` is per sample, without the batch dimension: ``(C, H, W)`` for
    images, ``(F,)`` for feature vectors, ``(T,)`` for windows of ``T``
    tokens. ``num_classes`` is the number of classes for classification, the
    number of regression targets for regression and the vocabulary size for
    language modelling (whose targets are the window's next ``T`` tokens; 0: not known yet).
    """

    shape: tuple[int, ...]
    num_classes: int
    task: Task = "classification"

    @property
    def is_image(self) -> bool:
        return len(self.shape) == 3

    @property
    def tokens_per_sample(self) -> int | None:
        """Tokens predicted per sample (language modelling: the window's length); None for other tasks."""
        return self.shape[0] if self.task == "language_modeling" else None

    @property
    def channels(self) -> int:
        return self.shape[0]

    @property
    def image_size(self) -> int:
        """The smaller side of an image input."""
        return min(self.shape[1:]) if self.is_image else 0
