"""One process, one device, no process group."""

from __future__ import annotations

from torch import nn

from nodescale.distributed.process_group import Runtime
from nodescale.strategies.torch_native import TorchNative


class SingleDevice(TorchNative):
    """Wraps nothing: the model on this process's device."""

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        return model.to(runtime.device)
