"""What the training loop needs to know about a model's structure and cost.

``repeated_blocks`` gives the units to shard (FSDP) or recompute (activation
checkpointing); ``forward_flops_per_sample`` gives the work per sample for
model FLOPs utilisation (MFU).

Each built-in model class declares its repeated blocks with a class attribute::

    class ResNet(nn.Module):
        block_types: tuple[type[nn.Module], ...] = (BasicBlock, Bottleneck)

Other models (the user's, Hugging Face's) are searched by the rules of
``repeated_blocks``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from nodescale.errors import UserError
from nodescale.models.hf_logits import CausalLMLogits
from nodescale.models.spec import InputSpec


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside the strategies' wrappers (DataParallel, DistributedDataParallel, DeepSpeed's
    engine; FSDP2 shards in place) and ``torch.compile``'s, and an ``hf:`` model's Hugging Face model inside
    its logits-only forward (same parameter names): the one unwrap of nodescale."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or _is_deepspeed_engine(model):
            model = model.module
        elif isinstance(model, CausalLMLogits):
            model = model.causal_lm
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def _is_deepspeed_engine(model: nn.Module) -> bool:
    # By its module's name: deepspeed is imported only when chosen.
    return type(model).__module__.startswith("deepspeed.") and isinstance(getattr(model, "module", None), nn.Module)


def repeated_blocks(model: nn.Module, unit_names: Sequence[str] = ()) -> list[nn.Module]:
    """The model's repeated blocks in forward order: the units of FSDP and activation checkpointing.

    Wrappers are seen through. The first rule that applies picks them:

    1. ``unit_names`` (``strategy.fsdp_units``): modules of those class names;
    2. the class's declared ``block_types`` (an empty tuple, like ``toy``'s: none);
    3. Hugging Face's ``_no_split_modules``: modules of those class names;
    4. the items of the model's ``nn.ModuleList`` holding the most parameters.

    Rules 1 and 3 take the outermost matches only (a unit inside a unit would be
    wrapped twice). The order is that of ``model.modules()``, the forward order
    when a model registers its blocks in the order it calls them, as every model
    here does. An empty list: callers treat the whole model as one unit.
    """
    inner = unwrap(model)
    if unit_names:
        wanted = set(unit_names)
        found = _outermost(inner, lambda module: type(module).__name__ in wanted)
        if not found:
            raise UserError(f"strategy.fsdp_units {','.join(unit_names)}", "no module of the model has these classes",
                            f"classes in the model: {', '.join(_class_names(inner))}")
        return found
    block_types = getattr(type(inner), "block_types", None)
    if block_types is not None:
        return [module for module in inner.modules() if isinstance(module, tuple(block_types))] if block_types else []
    no_split = set(getattr(inner, "_no_split_modules", None) or ())
    if no_split and (found := _outermost(inner, lambda module: type(module).__name__ in no_split)):
        return found
    lists = [module for module in inner.modules() if isinstance(module, nn.ModuleList) and len(module) > 0]
    if not lists:
        return []
    largest = max(lists, key=lambda items: sum(p.numel() for p in items.parameters()))  # the first, on a tie
    return list(largest)


def _outermost(model: nn.Module, matches: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Modules below ``model`` that ``matches``, skipping those inside one already taken."""
    found: list[nn.Module] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(prefix) for prefix in taken):
            continue
        if matches(module):
            found.append(module)
            taken.append(name + ".")
    return found


def _class_names(model: nn.Module, limit: int = 12) -> list[str]:
    """Class names of ``model``'s modules, the most frequent first (repeated blocks lead)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return sorted(counts, key=lambda name: -counts[name])[:limit]


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device.

    Meta tensors have shapes but no storage, so the copy takes no memory and
    running it does no arithmetic, however large the model. The tensors are
    handed to ``deepcopy`` ready-made rather than copied and then moved, so
    the real weights are never duplicated, not even briefly.
    """
    memo: dict[int, object] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def forward_flops_per_sample(model: nn.Module, spec: InputSpec) -> int:
    """FLOPs of one forward pass of one sample, counting 2 FLOPs per multiply-add.

    Counted by ``torch.utils.flop_counter.FlopCounterMode`` on a meta-device
    copy of the (unwrapped) model, so it costs no real compute or memory even
    for ResNet-152 at 224x224. Only matrix products, convolutions and attention
    are counted (elementwise work such as BatchNorm, activations and pooling
    is not), which is the usual convention for MFU. Because a multiply-add is
    2 FLOPs, the figures are twice the "MACs" often quoted as FLOPs: ResNet-50
    at 224x224 is about 8.2e9 here, the well-known "4.1 GFLOPs".
    """
    from torch.utils.flop_counter import FlopCounterMode  # only for MFU figures: not on every start-up

    meta_model = _meta_copy(unwrap(model)).eval()  # eval: BatchNorm accepts a batch of one
    dtype = torch.long if spec.task == "language_modeling" else torch.float32  # token ids, or values
    sample = torch.empty((1, *spec.shape), dtype=dtype, device="meta")
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        meta_model(sample)
    return int(counter.get_total_flops())


def training_flops_per_sample(model: nn.Module, spec: InputSpec) -> int:
    """FLOPs of forward and backward for one sample: 3x the forward.

    The backward pass costs about twice the forward (gradients with respect
    to both activations and weights), the standard estimate used for MFU.
    """
    return 3 * forward_flops_per_sample(model, spec)


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` has BatchNorm layers, whose fp32 running statistics low-precision casts leave alone."""
    return any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())
