"""Models by name, without importing torch.

Each entry names the module and builder function that make the model, so the
configuration can be validated (and ``--help`` printed) before torch loads.
Adding a model is one file in ``nodescale.models`` plus one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from nodescale.errors import unknown_choice
from nodescale.plugins.hf_dirs import is_hf_model

if TYPE_CHECKING:
    from torch import nn

    from nodescale.models.section import ModelSection
    from nodescale.models.spec import InputSpec


@dataclass(frozen=True)
class ModelEntry:
    """Where a model's builder lives and what task it does."""

    builder: str  # "module:function", the function taking (ModelSection, InputSpec)
    task: Literal["classification", "regression", "language_modeling", "any"]
    description: str
    has_blocks: bool = True  # declares repeated blocks (FSDP units, activation checkpointing)
    tensor_parallel: bool = False  # declares how its blocks split under --tp (tensor_parallel_plan)

    def build(self, cfg: ModelSection, spec: InputSpec) -> nn.Module:
        module_name, function_name = self.builder.split(":")
        module = importlib.import_module(module_name)
        return getattr(module, function_name)(cfg, spec)


MODELS: dict[str, ModelEntry] = {
    "toy": ModelEntry(
        "nodescale.models.toy:build_toy", "regression",
        "linear regression with MSE (the DDP tutorial's)", has_blocks=False,
    ),
    "gridconv": ModelEntry(
        "nodescale.models.gridconv:build_gridconv", "regression",
        "3 size-keeping convolutions (32 wide) from gridded inputs to gridded targets (--dataset zarr)",
        has_blocks=False,
    ),
    "cnn": ModelEntry(
        "nodescale.models.cnn:build_cnn", "classification",
        "2 conv-BN-ReLU-maxpool blocks (16, 32) + linear (CSC MNIST)",
    ),
    "resnet18": ModelEntry(
        "nodescale.models.resnet:build_resnet18", "classification",
        "ResNet-18, basic blocks",
    ),
    "resnet34": ModelEntry(
        "nodescale.models.resnet:build_resnet34", "classification",
        "ResNet-34, basic blocks",
    ),
    "resnet50": ModelEntry(
        "nodescale.models.resnet:build_resnet50", "classification",
        "ResNet-50, bottleneck blocks",
    ),
    "resnet101": ModelEntry(
        "nodescale.models.resnet:build_resnet101", "classification",
        "ResNet-101, bottleneck blocks",
    ),
    "resnet152": ModelEntry(
        "nodescale.models.resnet:build_resnet152", "classification",
        "ResNet-152, bottleneck blocks",
    ),
    "vit_tiny": ModelEntry(
        "nodescale.models.vit:build_vit_tiny", "classification",
        "ViT-Ti (192 wide, 12 blocks, 3 heads)",
    ),
    "vit_small": ModelEntry(
        "nodescale.models.vit:build_vit_small", "classification",
        "ViT-S (384 wide, 12 blocks, 6 heads)",
    ),
    "vit_b16": ModelEntry(
        "nodescale.models.vit:build_vit_b16", "classification",
        "ViT-B/16 (768 wide, 12 blocks, 12 heads)",
    ),
    "gpt_nano": ModelEntry(
        "nodescale.models.gpt:build_gpt_nano", "language_modeling",
        "Llama-style, 4 layers, 128 wide, 4 heads over 2 key/value heads (~1M parameters: tests, CPU)",
        tensor_parallel=True,
    ),
    "gpt2_small": ModelEntry(
        "nodescale.models.gpt:build_gpt2_small", "language_modeling",
        "GPT-2 small (124M: 12 layers, 768 wide, 12 heads, 1024 positions)",
        tensor_parallel=True,
    ),
    "gpt2_medium": ModelEntry(
        "nodescale.models.gpt:build_gpt2_medium", "language_modeling",
        "GPT-2 medium (355M: 24 layers, 1024 wide, 16 heads, 1024 positions)",
        tensor_parallel=True,
    ),
    "llama_1b": ModelEntry(
        "nodescale.models.gpt:build_llama_1b", "language_modeling",
        "Llama-3.2-1B-like (RoPE, RMSNorm, SwiGLU, 32 heads over 8 key/value heads, 16 layers, 2048 wide)",
        tensor_parallel=True,
    ),
}


# ``hf:DIR``: any causal language model that transformers builds from DIR/config.json.
HF_MODEL = ModelEntry(
    "nodescale.models.hf:build_hf", "language_modeling",
    "a Hugging Face causal language model from a local directory (config.json, safetensors weights)",
)


def model_entry(name: str) -> ModelEntry:
    """The entry of a built-in model name or of ``hf:DIR`` (not of the user's ``FILE.py:FN``)."""
    if is_hf_model(name):
        return HF_MODEL
    if name not in MODELS:
        raise unknown_choice("model", name, MODELS)
    return MODELS[name]


def build_model(cfg: ModelSection, spec: InputSpec) -> nn.Module:
    """The model named in ``cfg``, shaped for samples described by ``spec``.

    A name ``FILE.py:FUNCTION`` (or ``package.module:FUNCTION``) is the user's own
    function, called with ``cfg.args``; it does not need ``spec``.
    """
    if ":" in cfg.name and not is_hf_model(cfg.name):
        from nodescale.models.user_model import build_user_model

        return build_user_model(cfg)
    return model_entry(cfg.name).build(cfg, spec)
