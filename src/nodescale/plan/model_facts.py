"""What the plan knows of a model, measured by running it without memory (``fake_model``).

Parameter shapes come from building it; activation bytes from one forward of a whole
per-process batch, counting what autograd saves for backward; FLOPs from torch's FLOP
counter (``models.introspect``). Nothing here allocates real tensors, so ``llama_1b`` is
measured on a login node as quickly as ``cnn``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

import torch

from nodescale.errors import UserError
from nodescale.plan.fake_model import fake_tensors, on_meta_device, saved_for_backward

if TYPE_CHECKING:
    from nodescale.config.schema import RunConfig
    from nodescale.models.spec import InputSpec


@dataclass(frozen=True)
class ModelFacts:
    """A model's measured sizes and cost for one per-process batch."""

    shapes: tuple[tuple[int, ...], ...]  # trainable parameters, in ``model.parameters()`` order
    unit_parameters: tuple[int, ...]  # elements of each FSDP unit: the repeated blocks, then the rest
    forward_flops_per_sample: int
    batch_size: int
    activation_bytes: int  # saved for backward by one batch's forward
    checkpointed_activation_bytes: int  # the same with every repeated block recomputed

    @property
    def parameter_count(self) -> int:
        return sum(prod(shape) for shape in self.shapes)

    @property
    def training_flops_per_sample(self) -> int:
        """Forward and backward: 3x the forward (backward costs about twice the forward)."""
        return 3 * self.forward_flops_per_sample


def measure_model(cfg: RunConfig, spec: InputSpec) -> ModelFacts:
    """Build ``cfg``'s model without memory and run one per-process batch of ``spec``'s samples."""
    from nodescale.models.introspect import forward_flops_per_sample, repeated_blocks
    from nodescale.models.registry import build_model

    batch = cfg.train.batch_size
    try:
        with on_meta_device():
            model = build_model(cfg.model, spec)
    except Exception as exc:  # a model that builds for train fails here for want of values: say so
        raise cannot_build(cfg.model.name, exc) from None
    # Counted before the fake copy: moving to it unties tied weights (a GPT's embedding and output).
    shapes = tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    blocks = repeated_blocks(model, cfg.strategy.fsdp_units)
    in_blocks = [sum(p.numel() for p in block.parameters()) for block in blocks]
    with fake_tensors() as make_fake:
        try:
            model = make_fake(model)
            flops = forward_flops_per_sample(model, spec)
            model.train()
            dtype = torch.long if spec.task == "language_modeling" else torch.float32
            sample = torch.zeros((batch, *spec.shape), dtype=dtype)
            with saved_for_backward(model, blocks) as saved, _autocast(cfg.train.precision):
                model(sample)
        except UserError:
            raise
        except Exception as exc:  # any failure of the user's model here is about running it without memory
            raise cannot_build(cfg.model.name, exc) from None
    rest = sum(prod(shape) for shape in shapes) - sum(in_blocks)
    return ModelFacts(shapes, (*in_blocks, rest), flops, batch, saved.total, saved.checkpointed)


def _autocast(precision: str) -> torch.autocast | nullcontext[None]:
    if precision == "fp32":
        return nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def cannot_build(name: str, exc: BaseException) -> UserError:
    """The error for a model that does not build or run on fake (meta) tensors."""
    text = exc.rule if isinstance(exc, UserError) else str(exc)  # the plugin loader's error says it already
    reason = text.strip().splitlines()[0] if text.strip() else ""
    return UserError(
        f"--model {name}",
        "cannot be built and run without memory (fake tensors on the meta device): "
        + (reason[:200] if isinstance(exc, UserError) else f"{type(exc).__name__}: {reason[:200]}"),
        "give the shape of one input sample with --sample-shape (e.g. 3,224,224 for images, 1024 for token "
        "windows); a model that reads real tensor values while building cannot be planned",
    )
