"""The training loop: accumulation, precision, evaluation, checkpoints, timing.

Nothing in the step forces a host-device synchronisation: losses and
accuracies accumulate on the device and are reduced across ranks only every
``log_every`` optimiser steps, where the clock also reads the time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from nodescale.config.schema import RunConfig
from nodescale.data.loader import StepLoader
from nodescale.data.sharding import window_totals as planned_window_totals
from nodescale.dist.process_group import Runtime, barrier, gather_from_all
from nodescale.dist.watchdog import Watchdog
from nodescale.errors import UserError
from nodescale.models.spec import Task
from nodescale.strategies.base import Footprint, Strategy, Updater
from nodescale.train import checkpoint
from nodescale.train.clock import TrainClock, current_memory_bytes, peak_memory_bytes, synchronize
from nodescale.train.console import Console
from nodescale.train.evaluate import EvalResult, evaluate
from nodescale.train.loss import make_loss, model_output
from nodescale.train.metrics_log import MetricsLog
from nodescale.train.preemption import StopRequest

if TYPE_CHECKING:
    from nodescale.observe.profiler import StepProfiler

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Position:
    """Where training stands; saved in checkpoints."""

    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed
    global_step: int = 0  # optimiser steps taken

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "global_step": self.global_step}


@dataclass
class Timing:
    """What the clock saw, per rank, before the cross-rank reduction."""

    epoch_seconds: list[float] = field(default_factory=list)
    timed_seconds: float = 0.0
    timed_samples: int = 0
    timed_steps: int = 0
    includes_warmup: bool = False
    data_wait_seconds: float = 0.0


class Trainer:
    """Trains one wrapped model on one rank's share of the data."""

    def __init__(
        self,
        cfg: RunConfig,
        runtime: Runtime,
        strategy: Strategy,
        updater: Updater,
        runner: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        train_loader: StepLoader,
        val_loader: StepLoader,
        task: Task,
        run_dir: Path,
        console: Console,
        metrics: MetricsLog,
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.strategy = strategy
        self.updater = updater  # backward, accumulation, clipping and the optimiser step
        self.model = updater.model  # the strategy's wrapper (DDP, ..., DeepSpeed's engine), for state dicts
        self.runner = runner  # what forward is called on: ``model`` or its compiled form
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.task = task
        self.loss = make_loss(cfg.train.loss, task)  # per sample: auto (by task), cross_entropy, mse or the user's
        self.run_dir = run_dir
        self.console = console
        self.metrics = metrics
        self.device = runtime.device
        self.position = Position()
        self.saved_step: int | None = None  # the step of the newest checkpoint written by this run
        self.timing = Timing()
        self.last_eval: EvalResult | None = None
        self.footprint: Footprint | None = None  # measured once, before an optimiser step
        self.stop: StopRequest | None = None  # set by run_training: stop signals, agreed at step boundaries
        self.watchdog: Watchdog | None = None  # set by run_training: the heartbeat of this rank
        self.stopped_by: str | None = None  # the stop signal that ended fit() early, if one did
        self.profiler: StepProfiler | None = None  # set by run_training for --profile; started and stopped there
        precision = cfg.train.precision
        # fp32 needs no autocast context at all: entering a disabled one still costs every step.
        self.autocast: AbstractContextManager[Any] = (
            torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[precision]) if precision in AUTOCAST_DTYPES
            else nullcontext()
        )
        accum = cfg.train.grad_accum
        self.steps_per_epoch = -(-train_loader.plan.steps_per_epoch // accum)
        total = cfg.train.epochs * self.steps_per_epoch
        self.total_steps = min(total, cfg.train.max_steps) if cfg.train.max_steps else total

    # ----------------------------------------------------------------- state
    @property
    def sharded_checkpoints(self) -> bool:
        return checkpoint.is_sharded_format(self.cfg.checkpoint.format, self.strategy.name)

    def trainer_state(self) -> dict[str, Any]:
        """Everything a resumed run needs but the model and optimiser; a collective (every rank's RNG)."""
        rngs = gather_from_all(self.runtime, checkpoint.rng_state(self.device))
        return {
            "scheduler": self.scheduler.state_dict(),
            "updater": self.updater.state_dict(),
            "position": self.position.as_dict(),
            "world_size": self.runtime.world_size,
            "batch_size": self.cfg.train.batch_size,
            "rng": rngs,
            "config": self.cfg.model_dump(mode="json"),
        }

    def load_state_dict(self, state: dict[str, Any], path: Path) -> None:
        """Resume from ``state``: a full checkpoint, or the trainer state of the sharded one at ``path``."""
        if "model" in state:
            self.strategy.load_state_dict(self.model, self.optimizer, state)
        else:
            self._check_layout(state, path)
            self.strategy.load_sharded(self.model, self.optimizer, path)
        self.scheduler.load_state_dict(state["scheduler"])
        self.updater.load_state_dict(state["updater"])
        self.position = Position(**state["position"])
        same_layout = (state["world_size"] == self.runtime.world_size
                       and state["batch_size"] == self.cfg.train.batch_size)
        if same_layout:
            checkpoint.restore_rng(state["rng"][self.runtime.rank], self.device)
        elif self.position.batch_in_epoch:
            # The epoch's order is the same permutation, but it is dealt to a
            # different number of ranks: continue at the same share of the epoch.
            done = self.position.batch_in_epoch * state["batch_size"] * state["world_size"]
            per_step = self.cfg.train.batch_size * self.runtime.world_size
            self.position.batch_in_epoch = min(done // per_step, self.train_loader.plan.steps_per_epoch)
            self.console.note(
                f"resuming on {self.runtime.world_size} ranks x batch {self.cfg.train.batch_size} from a run on "
                f"{state['world_size']} x {state['batch_size']}: the current epoch continues at micro-batch "
                f"{self.position.batch_in_epoch}; exact continuation needs the same layout"
            )

    def _check_layout(self, state: dict[str, Any], path: Path) -> None:
        layout = state.get("layout")
        if layout != self.strategy.sharded_layout:
            writer = "DeepSpeed" if layout == "deepspeed" else "torch.distributed.checkpoint"
            raise UserError(
                f"--resume from {path} with strategy {self.strategy.name!r}",
                f"the checkpoint is in {writer}'s sharded format ({layout}), which this strategy does not read",
                f"resume with --strategy {state['config']['strategy']['name']}, or export the weights with "
                f"`nodescale checkpoint export {self.run_dir}` and start a new run",
            )

    def save_checkpoint(self) -> None:
        if self.saved_step == self.position.global_step:
            return  # the periodic save already wrote this step
        step = self.saved_step = self.position.global_step
        keep = self.cfg.checkpoint.keep_last
        trainer_state = self.trainer_state()  # every rank takes part in the RNG gather
        if self.sharded_checkpoints:
            trainer_state["layout"] = self.strategy.sharded_layout
            path = checkpoint.write_sharded(
                self.run_dir, step, self.runtime.is_main, lambda: barrier(self.runtime),
                lambda directory: self.strategy.save_sharded(self.model, self.optimizer, directory),
                lambda: trainer_state, keep,
            )
        else:
            state = {**self.strategy.state_dict(self.model, self.optimizer), **trainer_state}  # a collective
            path = checkpoint.checkpoint_path(self.run_dir, step)
            if self.runtime.is_main:
                checkpoint.save(self.run_dir, step, state, keep)
        if self.runtime.is_main:
            self.metrics.write({"kind": "checkpoint", "step": step, "path": str(path)})

    # ------------------------------------------------------------------ loop
    def fit(self) -> None:
        cfg = self.cfg.train
        clock = TrainClock(self.device)
        warmup = min(cfg.timing_warmup_steps, max(0, self.total_steps - self.position.global_step - 1))
        self.timing.includes_warmup = warmup == 0 and cfg.timing_warmup_steps > 0
        warm_at = self.position.global_step + warmup
        timed = warmup == 0
        every = self.cfg.checkpoint.every
        self.console.start(self.total_steps, self.position.global_step)
        window = _Window(self.device)
        self.runner.train()

        while not self._done():
            epoch = self.position.epoch
            start = self.position.batch_in_epoch
            # Planned once, before the clock starts: the loader and the window totals share it.
            planned = self.train_loader.plan.batches(epoch, start)
            window_totals = planned_window_totals([b.global_count for b in planned], start, self.cfg.train.grad_accum)
            epoch_clock = TrainClock(self.device)
            epoch_clock.start()
            clock.start()
            wait_started = time.perf_counter()
            for offset, batch in enumerate(self.train_loader.epoch(epoch, start, planned)):
                data_wait = time.perf_counter() - wait_started
                window.data_wait += data_wait
                if timed:
                    self.timing.data_wait_seconds += data_wait
                index = start + offset
                closes_window = (index + 1) % cfg.grad_accum == 0 or index + 1 == len(self.train_loader)
                self._micro_step(batch, window_totals[offset], closes_window, window)
                self.position.batch_in_epoch = index + 1
                if timed:
                    self.timing.timed_samples += batch.real_count
                if not closes_window:
                    wait_started = time.perf_counter()
                    continue
                self._optimizer_step()
                window.steps += 1
                step = self.position.global_step
                if self.profiler is not None:
                    self.profiler.step(step)
                if timed:
                    self.timing.timed_steps += 1
                if step == warm_at and not timed:
                    barrier(self.runtime)  # every rank's clock starts together, none counts a wait
                    clock.reset()
                    timed = True
                if step % cfg.log_every == 0 or step == self.total_steps:
                    self._log_interval(window)
                if every and step % every == 0:
                    clock.pause()
                    epoch_clock.pause()
                    with window.excluded(), self._pause_watchdog():
                        self.save_checkpoint()
                    epoch_clock.start()
                    clock.start()
                self.console.advance(step)
                if self.watchdog is not None:
                    self.watchdog.beat(step)
                if self._done():
                    break
                if self.stop is not None and self.stop.agreed():
                    self._stop_for_requeue(clock, epoch_clock)
                    return
                wait_started = time.perf_counter()
            clock.pause()
            epoch_clock.pause()
            if self.position.batch_in_epoch >= len(self.train_loader):
                # An epoch resumed half-way is not a whole epoch's time.
                if start == 0:
                    self.timing.epoch_seconds.append(epoch_clock.seconds)
                self._end_epoch(window, epoch_clock.seconds)
        if timed:
            self.timing.timed_seconds = clock.seconds
        self.console.stop()
        with self._pause_watchdog():
            if self.last_eval is None or self.position.batch_in_epoch != 0:  # stopped mid-epoch
                self.last_eval = self._evaluate()
            if self.cfg.checkpoint.at_end:
                self.save_checkpoint()

    def _stop_for_requeue(self, clock: TrainClock, epoch_clock: TrainClock) -> None:
        """Every rank agreed to stop at this step boundary: checkpoint it, and leave fit()."""
        assert self.stop is not None
        clock.pause()
        epoch_clock.pause()
        self.timing.timed_seconds = clock.seconds
        self.console.stop()
        self.stopped_by = self.stop.signal_name
        with self._pause_watchdog():
            self.save_checkpoint()
            # No rank may leave (and a launcher end the others) while rank 0 still writes.
            barrier(self.runtime)

    def _pause_watchdog(self) -> AbstractContextManager[Any]:
        return self.watchdog.paused() if self.watchdog is not None else nullcontext()

    def _done(self) -> bool:
        return self.position.global_step >= self.total_steps or self.position.epoch >= self.cfg.train.epochs

    def _micro_step(self, batch: Any, window_total: int, closes_window: bool, window: _Window) -> None:
        with self.updater.accumulating(closes_window):
            with self.autocast:
                output = model_output(self.runner(batch.x))
            losses = self.loss(output, batch.y)
            full = batch.real_count == len(batch.y)  # nearly every batch: padding needs no masking
            loss_sum = losses.sum() if full else (losses * batch.weights).sum()
            loss = loss_sum * (self.runtime.world_size / window_total)
            self.updater.backward(loss)
        predicted = output.detach().argmax(dim=1) if self.task == "classification" else None
        window.add(loss_sum.detach(), predicted, batch.y, None if full else batch.weights, batch.real_count)

    def _optimizer_step(self) -> None:
        # Measured where all three kinds exist: gradients of this step, optimiser state of
        # the step before (the second step of a run; the first when it is the only one).
        if self.footprint is None and (self.position.global_step > 0 or self.total_steps == 1):
            self.footprint = self.strategy.footprint(self.model, self.optimizer)
        self.updater.step()
        self.scheduler.step()
        self.position.global_step += 1

    def _log_interval(self, window: _Window) -> None:
        synchronize(self.device)
        seconds = window.elapsed()
        loss, accuracy, samples = window.reduce(self.runtime.distributed)
        # The slowest rank sets the pace, and the fullest one runs out of memory first.
        seconds, data_wait, memory = _largest((seconds, window.data_wait, current_memory_bytes(self.device)),
                                              self.runtime.distributed, self.device)
        steps = max(window.steps, 1)
        record = {
            "kind": "step",
            "step": self.position.global_step,
            "epoch": self.position.epoch,
            "loss": loss,
            "accuracy": accuracy,
            "lr": self.scheduler.get_last_lr()[0],
            "samples_per_second": samples / seconds if seconds > 0 else None,
            "step_seconds": seconds / steps,
            "data_wait_seconds": data_wait / steps,
            "compute_seconds": max(0.0, seconds - data_wait) / steps,
            "memory_bytes": int(memory),
        }
        self.metrics.write(record)
        self.console.interval(record)
        window.restart()

    def _end_epoch(self, window: _Window, seconds: float) -> None:
        if window.steps:
            self._log_interval(window)
        with window.excluded(), self._pause_watchdog():
            result = self._evaluate()
        self.last_eval = result
        record = {
            "kind": "epoch",
            "epoch": self.position.epoch,
            "step": self.position.global_step,
            "epoch_seconds": seconds,
            "val_loss": result.loss,
            "val_accuracy": result.accuracy,
            "val_samples": result.samples,
        }
        self.metrics.write(record)
        self.console.epoch(record, self.cfg.train.epochs)
        self.position.epoch += 1
        self.position.batch_in_epoch = 0

    def _evaluate(self) -> EvalResult:
        # Evaluate through the strategy's wrapper so sharded strategies gather
        # their parameters; DDP's wrapper is bypassed (its forward would sync buffers).
        model = self.strategy.unwrap(self.model) if self.strategy.name == "ddp" else self.runner
        return evaluate(model, self.val_loader, self.task, self.autocast, self.runtime.distributed, self.loss)

    def peak_memory(self) -> tuple[int, str]:
        return peak_memory_bytes(self.device)


class _Window:
    """Training metrics between two log points, accumulated on the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.restart()

    def restart(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.predictions: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.count = 0
        self.steps = 0
        self.data_wait = 0.0
        self.started = time.perf_counter()
        self.excluded_seconds = 0.0

    def add(self, loss_sum: torch.Tensor, predicted: torch.Tensor | None, target: torch.Tensor,
            weights: torch.Tensor | None, real_count: int) -> None:
        """One micro-batch: its summed loss, predicted classes, padding weights (None: none) and size.

        Predictions are only kept here and compared with the targets at the log point, in one
        go: per step that is one device operation instead of three.
        """
        self.loss_sum = self.loss_sum + loss_sum
        if predicted is not None:
            self.predictions.append((predicted, target, weights))
        self.count += real_count  # known on the host: no device work for it

    def _hits(self) -> torch.Tensor:
        hits = torch.zeros((), dtype=torch.float64, device=self.device)
        for predicted, target, weights in self.predictions:
            right = (predicted == target).to(torch.float64)
            hits = hits + (right.sum() if weights is None else (right * weights).sum())
        return hits

    def elapsed(self) -> float:
        return time.perf_counter() - self.started - self.excluded_seconds

    @contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside (checkpointing, evaluation) does not count as training."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.excluded_seconds += time.perf_counter() - began

    def reduce(self, distributed: bool) -> tuple[float, float | None, int]:
        """Mean loss, accuracy and sample count of the window over all ranks (one all-reduce)."""
        totals = torch.stack((self.loss_sum, self._hits(), torch.tensor(float(self.count), dtype=torch.float64,
                                                                         device=self.device)))
        if distributed:
            dist.all_reduce(totals)
        loss_sum, hits, count = totals.tolist()
        count = max(count, 1.0)
        return loss_sum / count, (hits / count if self.predictions else None), int(count)


def _largest(values: tuple[float, ...], distributed: bool, device: torch.device) -> tuple[float, ...]:
    """Each value's maximum over the ranks (one all-reduce; the values themselves without a group)."""
    if not distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tuple(tensor.tolist())
