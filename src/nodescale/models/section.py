"""The ``model:`` section of a run's configuration (validated without importing torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from nodescale.errors import UserError
from nodescale.models.registry import MODELS
from nodescale.section import Section, known_or_plugin


class ModelSection(Section):
    name: str = Field(
        "cnn", description="model to train: a built-in one (see `nodescale models`), hf:DIR (a Hugging Face causal "
        "language model in a local directory), or your function that returns an nn.Module, FILE.py:FUNCTION or "
        "package.module:FUNCTION"
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of your model function, e.g. --set model.args.width=64"
    )
    weights: Path | None = Field(
        None, description="a local state dict file (torch.save) loaded into the model once built, before the "
        "strategy wraps it"
    )
    stem: Literal["auto", "imagenet", "cifar"] = Field(
        "auto", description="ResNet stem: imagenet (7x7/2 + maxpool), cifar (3x3/1), auto by image size"
    )
    patch_size: int | None = Field(
        None, ge=1, description="ViT patch size; default: the model's own, shrunk for small images"
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability (ViT, GPT models)")
    tie_weights: bool = Field(
        True, description="GPT models: the output layer shares the token embedding's weights"
    )

    @field_validator("name")
    @classmethod
    def _known_model(cls, value: str) -> str:
        return known_or_plugin("model", value, MODELS)

    @field_validator("weights")
    @classmethod
    def _weights_file(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise UserError(f"model.weights {str(value)!r}", "is not a file",
                            "give the path of a state dict saved with torch.save(model.state_dict(), PATH)")
        return value
