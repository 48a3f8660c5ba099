"""``nodescale train``'s training loop, written on the library's calls (``docs/library.md``).

It is the loop of a user's script: copy it and change it. Each part decides its own
timing, as in torchtitan's ``train()``: the metrics log every ``log_every`` steps, the
checkpoint every ``checkpoint.every`` steps, the profiler over its window, evaluation at
each epoch's end, the stop agreement at every step boundary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nodescale.config.schema import RunConfig
from nodescale.data.epoch_loader import EpochLoader
from nodescale.engine.summary import EvalResult
from nodescale.engine.work import perplexity
from nodescale.models.spec import Task
from nodescale.train.console import Console
from nodescale.train.evaluate import evaluate
from nodescale.train.loss import LossFn, model_output
from nodescale.train.step_metrics import StepMetrics

if TYPE_CHECKING:
    from nodescale.api import Context
    from nodescale.observe.profiler import StepProfiler


def train(ctx: Context, cfg: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          scheduler: torch.optim.lr_scheduler.LRScheduler, loader: EpochLoader, val_loader: EpochLoader,
          loss: LossFn, task: Task, total_steps: int, console: Console,
          profiler: StepProfiler | None = None) -> EvalResult:
    """Train ``model`` up to ``total_steps`` optimiser steps or ``cfg.train.epochs``; the last evaluation."""
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    metrics = StepMetrics(ctx, loader, task)
    every, epochs, saved_at = cfg.checkpoint.every, cfg.train.epochs, -1
    evaluation: EvalResult | None = None
    eval_model = ctx.unwrap(model) if cfg.strategy.name == "ddp" else model  # DDP's forward would sync buffers
    console.start(total_steps, ctx.global_step)
    model.train()
    while ctx.global_step < total_steps and loader.epoch < epochs:
        for x, y in loader:
            with ctx.autocast():
                output = model_output(model(x))
            batch_loss = loss(output, y).mean()  # ctx.backward makes it the global mean over the step's samples
            metrics.add(batch_loss, output, y, loader.real_count)
            del output  # not kept through backward: a language model's logits are the step's largest tensor
            ctx.backward(batch_loss)
            if not ctx.step(optimizer):
                continue  # accumulating: the window's last micro-batch steps
            scheduler.step()
            step = ctx.global_step
            if profiler is not None:
                profiler.step(step)
            if step % cfg.train.log_every == 0 or step == total_steps:
                console.interval(metrics.log(step, loader.epoch, scheduler.get_last_lr()[0]))
            if every and step % every == 0:
                ctx.save_checkpoint(state)
                saved_at = step
            console.advance(step)
            if step >= total_steps:
                break
            if ctx.should_stop():  # a signal reached some rank: every rank saves this step and leaves
                console.stop()
                if saved_at != step:
                    ctx.save_checkpoint(state)
                ctx.exit_for_requeue()
        if loader.batch_in_epoch == 0:  # the epoch ran to its end: its last figures and evaluation, untimed
            with ctx.untimed():
                if ctx.global_step > metrics.first_step:
                    console.interval(metrics.log(ctx.global_step, loader.epoch - 1, scheduler.get_last_lr()[0]))
                evaluation = evaluate(ctx, eval_model, val_loader, loss, task)
                record = _epoch_record(loader, evaluation, task)
                ctx.log(record, reduce=None, kind="epoch")
                console.epoch(record, epochs)
    console.stop()
    if evaluation is None or loader.batch_in_epoch != 0:  # stopped mid-epoch
        evaluation = evaluate(ctx, eval_model, val_loader, loss, task)
    if cfg.checkpoint.at_end and saved_at != ctx.global_step:
        ctx.save_checkpoint(state)
    return evaluation


def _epoch_record(loader: EpochLoader, evaluation: EvalResult, task: Task) -> dict[str, Any]:
    record = {"epoch": loader.epoch - 1, "epoch_seconds": loader.last_epoch_seconds, "val_loss": evaluation.loss,
              "val_accuracy": evaluation.accuracy, "val_samples": evaluation.samples}
    if task == "language_modeling":
        record["val_perplexity"] = perplexity(evaluation.loss)
    return record
