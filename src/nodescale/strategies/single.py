"""One process, one device, no process group."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn

from nodescale.dist.process_group import Runtime


class SingleDevice:
    name = "single"
    needs_process_group = False

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        return model.to(runtime.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        return nullcontext()
