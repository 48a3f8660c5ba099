"""``DistributedDataParallel``: one process per device, gradients all-reduced in buckets."""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nodescale.config.strategy import DDPSection
from nodescale.distributed.process_group import Runtime
from nodescale.distributed.sync_batchnorm import convert_sync_batchnorm
from nodescale.strategies.torch_native import TorchNative


class DDPStrategy(TorchNative):
    """The model wrapped in ``DistributedDataParallel`` with the section's bucket and graph options."""

    cfg: DDPSection

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        if self.cfg.sync_batchnorm:
            model = convert_sync_batchnorm(model, runtime.device.type)
        model = model.to(runtime.device)
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        # Only an explicit bucket size is passed: any value, even DDP's own 25, turns off the
        # small first bucket that lets the first all-reduce start early in backward.
        buckets = {"bucket_cap_mb": self.cfg.bucket_cap_mb} if self.cfg.bucket_cap_mb is not None else {}
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            **buckets,
            static_graph=self.cfg.static_graph,
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view,
            find_unused_parameters=self.cfg.find_unused_parameters,
        )

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        return model.no_sync()
