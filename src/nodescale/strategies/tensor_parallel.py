"""Tensor parallelism (``--tp N``): each block's linear layers split over a group of N ranks, Megatron style.

The model declares the split and holds no parallelism itself: ``tensor_parallel_plan()`` names
each block's linear layers (paths within a block) ``"colwise"`` (output features split: whole heads,
or a slice of the MLP's width, per rank) or ``"rowwise"`` (input features split, the partial products
all-reduced). A column split feeds a row split, so each pair costs one all-reduce forward and one
backward. DTensor's ``parallelize_module`` applies it with local outputs, so the model's
``view(batch, tokens, -1, head_dim)`` finds this rank's heads/N (and key/value heads/N) heads.
``tensor_parallel_divisors()``, where declared, adds the counts N must divide (heads).

Every other parameter (embeddings, norms, the output layer) is replicated over the group as a
DTensor (:func:`replicate_the_rest`): once FSDP shards all of them over ``dp``, every parameter
lives on the one 2-D mesh, which ``clip_grad_norm_`` (one norm over all of them) needs; torchtitan's
``NoParallel`` does the same. The output layer stays whole on every rank of a group: the loss sees
ordinary logits and tied embeddings stay tied, for the price of each rank repeating the output
projection (a vocabulary-split output with a parallel loss would save it).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from nodescale.errors import UserError
from nodescale.models.introspect import repeated_blocks

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def checked_plan(model: nn.Module, size: int) -> tuple[list[nn.Module], dict[str, str]]:
    """The blocks to split and the model's plan, refused (UserError) where they do not split over ``size`` ranks.

    Needs no process group: it runs before the mesh is made.
    """
    what = f"--tp {size} with model {type(model).__name__}"
    declared = getattr(model, "tensor_parallel_plan", None)
    blocks = repeated_blocks(model)
    if not callable(declared) or not blocks:
        raise UserError(what, "the model declares no tensor-parallel plan for its blocks",
                        "give its class a tensor_parallel_plan() method (see docs/language-models.md), or drop --tp")
    plan: dict[str, str] = declared()
    divisors = getattr(model, "tensor_parallel_divisors", None)
    counts: dict[str, int] = dict(divisors()) if callable(divisors) else {}
    for path, style in plan.items():
        layer = blocks[0].get_submodule(path)
        if style not in STYLES or not isinstance(layer, nn.Linear):
            raise ValueError(f"{type(model).__name__}.tensor_parallel_plan: {path!r} must name an nn.Linear of "
                             f"each block as 'colwise' or 'rowwise', not {style!r} for {type(layer).__name__}")
        split = "output" if style == "colwise" else "input"
        counts[f"{path} {split} features"] = layer.out_features if style == "colwise" else layer.in_features
    for name, count in counts.items():
        if count % size:
            common = math.gcd(*counts.values())
            fits = [str(n) for n in range(2, min(common, 64) + 1) if common % n == 0]
            raise UserError(what, f"its {name} ({count}) do not divide evenly over {size} ranks",
                            f"use --tp {' or '.join(fits)}" if fits else "drop --tp: nothing divides them all")
    return blocks, plan


class _TwoGathersNote(logging.Filter):
    """DTensor notes (a warning per rank) that gathering a tensor sharded by FSDP over its TP shards takes two
    all-gathers, when full state dicts are made (``--checkpoint-format full``): nothing to change, not shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "non-ascending order all_gather" not in record.getMessage()


_REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")


def apply_tensor_parallel(model: nn.Module, blocks: list[nn.Module], plan: dict[str, str], mesh: DeviceMesh) -> None:
    """Split ``blocks`` by ``plan`` over the 1-D tensor-parallel ``mesh``; replicate the rest of ``model`` over it."""
    if not any(isinstance(f, _TwoGathersNote) for f in _REDISTRIBUTE_LOG.filters):
        _REDISTRIBUTE_LOG.addFilter(_TwoGathersNote())
    for block in blocks:
        parallelize_module(block, mesh, {path: STYLES[style]() for path, style in plan.items()})
    replicate_the_rest(model, mesh)
    model.register_forward_hook(_not_a_view)  # before FSDP's own hook, which then sees the copy


def _not_a_view(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
    # A replicated last layer (the output projection) gives DTensor.to_local's view of its result. In-place
    # changes to a view returned by an FSDP module would bypass FSDP's backward hook (FSDP2 warns of it), so
    # the model returns its own tensor: one copy of the logits, small beside the projection that made them.
    return output.clone() if isinstance(output, torch.Tensor) and output._base is not None else output


def replicate_the_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Each module's own plain parameters become DTensors replicated over ``mesh``; the module still takes and
    gives plain (local) tensors. A parameter shared by several modules (tied weights) stays one parameter."""
    replicas: dict[int, nn.Parameter] = {}

    def replicate(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name:  # distribute_module visits the children too; each module with parameters gets its own call
            return
        for key, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                if id(param) not in replicas:
                    replicas[id(param)] = nn.Parameter(distribute_tensor(param.detach(), device_mesh, [Replicate()]),
                                                       requires_grad=param.requires_grad)
                module.register_parameter(key, replicas[id(param)])

    owners = [module for module in model.modules()
              if any(p is not None and not isinstance(p, DTensor) for p in module._parameters.values())]
    for module in owners:
        distribute_module(module, mesh, replicate, _replicated_inputs, _local_output)


def _replicated_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    # Every rank of the group holds the same activations: they are the replicated DTensor's local value.
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _local_output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output
