"""Batch normalisation over the global batch on any device, for DDP on CPU (gloo) as well as GPUs.

``torch.nn.SyncBatchNorm`` refuses CPU tensors ("SyncBatchNorm expected input tensor to be on
GPU"), so a CPU run of a multi-rank job (tests, laptops, CPU clusters) could not use synced
statistics at all. :class:`CpuSyncBatchNorm` computes them with plain tensor ops and two
all-reduces; :func:`convert_sync_batchnorm` picks it or torch's fused CUDA version by device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

# torch.nn.SyncBatchNorm accepts these device types (torch 2.13); elsewhere it raises.
_TORCH_SYNC_BN_DEVICES = ("cuda", "xpu", "hpu")
_REPLACED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class _AllReduceSum(torch.autograd.Function):
    """A differentiable sum over ranks: the gradient of a sum is the sum of the gradients.

    Same maths as ``torch.distributed.nn.functional.all_reduce``, which warns a FutureWarning
    on every call in torch 2.13 (and so on every forward of every BatchNorm layer).
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        reduced = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        return reduced

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _AllReduceSum.apply(grad, ctx.group), None


class CpuSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover the batch of every rank, on any device.

    In training mode, with an initialised process group of more than one rank, the mean and
    variance per channel are those of the global batch (all ranks' samples together), and
    gradients flow through them to every rank's input. Otherwise (eval mode, no process group,
    one rank) it is exactly :class:`torch.nn.BatchNorm2d` and friends. Accepts inputs of shape
    (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2 or input.dim() > 5:
            raise ValueError(f"expected 2D to 5D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and self._world_size() > 1):
            return super().forward(input)
        self._check_input_dim(input)
        factor = self._update_factor()
        # Half precision is normalised in float32, as torch's batch norm kernels do.
        work = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        mean, biased_var, unbiased_var = self._global_moments(work)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            # BatchNorm normalises with the biased variance but tracks the unbiased one.
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(
                    mean.detach().to(self.running_mean.dtype), alpha=factor
                )
                self.running_var.mul_(1 - factor).add_(
                    unbiased_var.detach().to(self.running_var.dtype), alpha=factor
                )
        shape = _channel_shape(work)
        out = (work - mean.view(shape)) * torch.rsqrt(biased_var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        return out.to(input.dtype)

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def _update_factor(self) -> float:
        """Count the batch and return the running-average weight, exactly as ``_BatchNorm.forward``."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def _global_moments(self, work: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, biased and unbiased variance per channel over every rank's batch, differentiable.

        Two passes (mean first, then squared deviations from it) rather than E[x²]-E[x]²,
        which cancels catastrophically when the mean is large compared to the spread.
        """
        dims = [0, *range(2, work.dim())]
        channels = work.shape[1]
        local_count = work.numel() // channels if channels else 0
        counts = torch.full((channels, 1), float(local_count), dtype=work.dtype, device=work.device)
        # One collective for sums and counts together; ranks may hold different batch sizes.
        packed = _AllReduceSum.apply(
            torch.cat([work.sum(dims).unsqueeze(1), counts], dim=1), self.process_group
        )
        total, count = packed[:, 0], packed[:, 1].detach()
        if channels and float(count[0]) <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {int(count[0])} over all ranks"
            )
        mean = total / count
        squares = _AllReduceSum.apply(
            ((work - mean.view(_channel_shape(work))) ** 2).sum(dims), self.process_group
        )
        return mean, squares / count, squares / (count - 1)


def _channel_shape(tensor: Tensor) -> list[int]:
    """The shape that broadcasts a per-channel vector over (N, C, ...)."""
    return [1, -1] + [1] * (tensor.dim() - 2)


def convert_sync_batchnorm(
    module: nn.Module, device_type: str, process_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Make every BatchNorm layer of ``module`` normalise over the global batch.

    On devices torch's fused :class:`torch.nn.SyncBatchNorm` supports (``"cuda"``, which
    includes ROCm, ``"xpu"``, ``"hpu"``) this is
    :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm`. Elsewhere every ``BatchNorm1d/2d/3d``
    (and ``SyncBatchNorm``) becomes a :class:`CpuSyncBatchNorm` that shares its parameters and
    buffers (so ``requires_grad``, values and optimizer references carry over) and keeps its
    eps, momentum, affine, track_running_stats and train/eval mode. Returns the converted module,
    which is ``module`` itself unless ``module`` is a BatchNorm layer.
    """
    if device_type in _TORCH_SYNC_BN_DEVICES:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _convert_cpu(module, process_group)


def _convert_cpu(module: nn.Module, process_group: dist.ProcessGroup | None) -> nn.Module:
    converted = module
    if isinstance(module, _REPLACED) and not isinstance(module, CpuSyncBatchNorm):
        converted = CpuSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        # Assign the very same Parameter and buffer objects, as torch's converter does.
        with torch.no_grad():
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, _convert_cpu(child, process_group))
    return converted
