"""``nn.DataParallel``: one process driving every GPU of a node.

Kept because the seeds teach it for one node; it is slower than DDP (one
Python thread scatters inputs and gathers outputs every step, and the
replicas are re-broadcast each forward), so using it warns.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from nodescale.distributed.process_group import Runtime
from nodescale.strategies.torch_native import TorchNative


class DataParallelStrategy(TorchNative):
    """The model replicated over a node's GPUs by ``nn.DataParallel`` in every forward."""

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        warnings.warn(
            "strategy 'dp' (nn.DataParallel) is slower than DDP even on one node; "
            "use --strategy ddp --nproc <GPUs>", stacklevel=2,
        )
        model = model.to(runtime.device)
        if runtime.device.type == "cuda" and torch.cuda.device_count() > 1:
            return nn.DataParallel(model)
        warnings.warn("strategy 'dp' found fewer than 2 GPUs; running on one device", stacklevel=2)
        return model
