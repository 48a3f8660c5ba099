"""Training metrics between two log points, accumulated on the device.

Nothing here forces a host-device synchronisation per step: losses and predictions
stay on the device and are reduced across ranks only at a log point (every
``log_every`` optimiser steps), where the time is also read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nodescale.data.epoch_loader import EpochLoader
from nodescale.distributed.process_group import sums_and_maxima
from nodescale.engine.device import current_memory_bytes
from nodescale.engine.summary import devices_per_process
from nodescale.models.spec import Task
from nodescale.train.loss import correct

if TYPE_CHECKING:
    from nodescale.api import Context


class StepMetrics:
    """Loss, accuracy, throughput, data wait and memory of each log interval: one ``step`` record each."""

    def __init__(self, ctx: Context, loader: EpochLoader, task: Task) -> None:
        self.ctx, self.loader, self.task = ctx, loader, task
        self.restart()

    def restart(self) -> None:
        self.losses: list[tuple[torch.Tensor, int]] = []  # (mean loss, real samples) of each micro-batch
        self.right: list[torch.Tensor] = []  # per real sample: 1/0 (classes), the share of tokens right (language)
        self.count = 0
        self.first_step = self.ctx.global_step
        self.started = self.ctx.record.synced_time()
        self.waited = self.loader.wait_seconds

    def add(self, loss: torch.Tensor, output: torch.Tensor, target: torch.Tensor, real: int) -> None:
        """One micro-batch: its mean loss and outputs, of which the first ``real`` are samples.

        Losses and hits are only kept here and summed at the log point, in one go: the step itself
        gets no device synchronisation from the metrics.
        """
        if real == 0:
            return  # a padding batch
        self.losses.append((loss.detach(), real))
        right = correct(output.detach()[:real], target[:real], self.task)
        if right is not None:
            self.right.append(right)
        self.count += real  # known on the host: no device work for it

    def log(self, step: int, epoch: int, lr: float) -> dict[str, Any]:
        """The interval's record over all ranks, written to the run's metrics (a collective)."""
        seconds = self.ctx.record.synced_time() - self.started
        hits = sum((right.sum(dtype=torch.float64) for right in self.right),
                   torch.zeros((), dtype=torch.float64, device=self.ctx.device))
        loss_sum = sum((mean.double() * real for mean, real in self.losses),
                       torch.zeros((), dtype=torch.float64, device=self.ctx.device))
        totals = torch.stack((loss_sum, hits, torch.tensor(float(self.count), dtype=torch.float64,
                                                                device=self.ctx.device)))
        # The slowest rank sets the pace, and the fullest one runs out of memory first.
        largest = torch.tensor((seconds, self.loader.wait_seconds - self.waited,
                                float(current_memory_bytes(self.ctx.device))), dtype=torch.float64,
                               device=self.ctx.device)
        totals, largest = sums_and_maxima(self.ctx.runtime, totals, largest)
        loss_sum, hits_sum, count = totals.tolist()
        seconds, waited, memory = largest.tolist()
        count, steps = max(count, 1.0), max(step - self.first_step, 1)
        record = {
            "epoch": epoch,
            "loss": loss_sum / count,
            "accuracy": None if self.task == "regression" else hits_sum / count,
            "lr": lr,
            "samples_per_second": count / seconds if seconds > 0 else None,
            "step_seconds": seconds / steps,
            "data_wait_seconds": waited / steps,
            "compute_seconds": max(0.0, seconds - waited) / steps,
            "memory_bytes": int(memory),
        }
        work = self.ctx.record.work
        if work is not None:  # a language model: its tokens/s and MFU
            devices = self.ctx.world_size * devices_per_process(self.ctx.cfg, self.ctx.device)
            record.update(work.figures(record["samples_per_second"], devices))
        self.ctx.log(record, step, reduce=None)
        self.restart()
        return {"step": step, **record}
