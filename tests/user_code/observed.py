"""One of nodescale's own models, with a record of what some of its modules saw in each forward on each rank.

For the tests that show a setting took effect inside the ranks, not only in the summary it writes
(tests/test_fsdp.py and test_deepspeed.py: bf16; test_activation_checkpointing.py: recomputation)::

    --model observed.py:build --set model.args.model=vit_tiny --set model.args.shape=[3,8,8]
    --set model.args.record=DIR --set model.args.watch=[blocks.0.mlp.0] --set model.args.patch_size=4

builds nodescale's ``vit_tiny`` for 3 x 8 x 8 samples of 10 classes, as ``--model vit_tiny`` would
(the other keyword arguments are settings of the model section). Each forward of a watched module
appends a line to ``DIR/rank-R.jsonl``: the module's name, whether it trained with gradients on,
and the dtypes of its input, its weight as the forward used it, and its output.
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from nodescale.models.registry import build_model
from nodescale.models.section import ModelSection
from nodescale.models.spec import InputSpec


def build(record, watch, model="cnn", shape=(1, 8, 8), classes=10, **settings):
    built = build_model(ModelSection(name=model, **settings), InputSpec(tuple(shape), classes))
    modules = dict(built.named_modules())
    for name in watch:
        modules[name].register_forward_hook(_recorder(name, Path(record)))
    return built


def _dtype(value):
    value = value[0] if isinstance(value, (tuple, list)) and value else value
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None


def _recorder(name, record):
    def hook(module, inputs, output):
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
        line = {"module": name, "training": module.training and torch.is_grad_enabled(), "input": _dtype(inputs),
                "weight": _dtype(getattr(module, "weight", None)), "output": _dtype(output)}
        record.mkdir(parents=True, exist_ok=True)
        with open(record / f"rank-{rank}.jsonl", "a") as handle:
            handle.write(json.dumps(line) + "\n")

    return hook

