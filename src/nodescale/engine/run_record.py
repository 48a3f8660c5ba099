"""What a run leaves behind, for both faces: metrics, honest throughput, summary, stop, heartbeat.

With a run directory there are ``config.yaml``, ``metrics.jsonl``/``metrics.csv`` (and the
chosen loggers) from ``ctx.log``, and ``summary.json`` at ``ctx.close()``. Throughput counts
the real samples every rank drew from its training ``ctx.loader`` after the warm-up steps,
over the slowest rank's training time from the end of warm-up to the last optimiser step.
The training clock leaves out checkpoint saves and whatever runs under ``ctx.untimed()``
(evaluation), and synchronises the device only where it is read, never per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nodescale.atomic_files import write_json_atomic, write_text_atomic
from nodescale.config.load import dump_yaml
from nodescale.config.schema import RunConfig
from nodescale.data.epoch_loader import EpochLoader
from nodescale.distributed.process_group import Runtime, barrier, sum_over_replicas
from nodescale.distributed.watchdog import start_watchdog
from nodescale.engine.device import peak_memory_bytes, synchronize
from nodescale.engine.file_errors import reported
from nodescale.engine.metrics_log import MetricsLog
from nodescale.engine.preemption import StopRequest, stop_check_interval, write_requeue_file
from nodescale.engine.run_dir import claim_together
from nodescale.engine.run_lock import RunLock
from nodescale.engine.summary import EvalResult, Timing, gather_summary
from nodescale.engine.work import SampleWork
from nodescale.errors import UserError
from nodescale.observe.loggers import make_sinks
from nodescale.stop_signals import EXIT_REQUEUE, parse_signals
from nodescale.strategies.base import Footprint


class RunRecord:
    """One run's files, clocks, stop agreement and heartbeat.

    ``library``: a script's run (names come from its objects, the files open at once, the
    stop handlers at the first ``should_stop``); else ``nodescale train``'s, which opens the
    files after its resume was accepted and listens for stop signals from the start.
    """

    def __init__(self, cfg: RunConfig, runtime: Runtime, started: float, library: bool = True) -> None:
        self.cfg, self.runtime, self.started, self.library = cfg, runtime, started, library
        self.run_dir: Path | None = cfg.out
        self.lock: RunLock | None = None
        if library:  # a script resumes whatever its directory holds: no --resume to ask for
            self.claim(resume=True, flag="out=")
        self.metrics: MetricsLog | None = None
        self.watchdog = start_watchdog(runtime, cfg.train.heartbeat_timeout_s)
        self.stop: StopRequest | None = None if library else self._stop_request()
        self.timing = Timing()
        self.steps = 0  # optimiser steps of the run (a resumed run's included)
        self.total_steps: int | None = None  # where known (nodescale train): shortens the warm-up of short runs
        self.warmup_steps = cfg.train.timing_warmup_steps
        self.footprint: Footprint | None = None
        self.train_loader: EpochLoader | None = None
        self.last_values: dict[str, Any] = {}
        self.summary_extra: dict[str, Any] = {}  # more for summary.json (nodescale train's monitor, profile)
        self.work: SampleWork | None = None  # a language model's tokens and FLOPs per sample (nodescale train)
        self._steps_here = 0  # optimiser steps of this process
        self._timed_since: float | None = None  # training time at the end of warm-up
        self._wait_at_warm = 0.0
        self._excluded = 0.0  # seconds left out of the training time
        self._untimed_since: float | None = None  # when the untimed block in progress began
        self._unsynced = False  # a step ended since the device was last synchronised
        self._first_step_end = 0.0  # training time at this process's first step's end
        self._stop_every = 1  # steps between two stop agreements (set at the end of the warm-up)
        self._last_agreement: int | None = None  # the step of the last one
        if library:
            self.open(resumed=self.run_dir is not None and (self.run_dir / "checkpoints").is_dir())

    def claim(self, resume: bool, flag: str = "--out") -> None:
        """Every rank: the run directory is this run's until :meth:`close` (:mod:`nodescale.engine.run_dir`)."""
        if self.run_dir is not None:
            self.lock = claim_together(self.run_dir, self.runtime, resume, flag)

    def open(self, resumed: bool) -> None:
        """Rank 0 writes config.yaml, and the metric loggers start (with a run directory)."""
        if self.run_dir is None:
            return
        if self.runtime.is_main:
            config = self.run_dir / "config.yaml"
            with reported(f"{config}", config, "check the file system"):
                write_text_atomic(config, dump_yaml(self.cfg))
        sinks = make_sinks(self.cfg.observe, self.run_dir) if self.runtime.is_main else []
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", self.runtime.is_main, sinks)
        self.metrics.start(self.cfg.model_dump(mode="json"), resumed=resumed)

    # ------------------------------------------------------------------ clock
    def training_time(self) -> float:
        """Seconds of training so far on this rank (not synchronised: call :meth:`sync_point` to be exact);
        it stands still inside an untimed block."""
        return (self._untimed_since or time.perf_counter()) - self._excluded

    def synced_time(self) -> float:
        """:meth:`training_time` once the device has caught up (an epoch's end)."""
        self.sync_point()
        return self.training_time()

    def sync_point(self) -> None:
        """The device catches up; the timed seconds then end with the last step's work done."""
        if self._unsynced:
            synchronize(self.runtime.device)
            if self._timed_since is not None:
                self.timing.timed_seconds = self.training_time() - self._timed_since
            self._unsynced = False

    @contextmanager
    def untimed(self) -> Iterator[None]:
        """Time inside does not count as training, and the watchdog does not expect steps."""
        if self._untimed_since is not None:  # nested (a save inside your evaluation): the outer block counts
            yield
            return
        self.sync_point()
        self._untimed_since = time.perf_counter()
        paused = self.watchdog.paused() if self.watchdog is not None else nullcontext()
        try:
            with paused:
                yield
        finally:
            synchronize(self.runtime.device)
            self._excluded += time.perf_counter() - self._untimed_since
            self._untimed_since = None

    def stepped(self, samples: int) -> None:
        """An optimiser step ended, with ``samples`` real samples drawn since the one before."""
        self.steps += 1
        self._steps_here += 1
        if self._steps_here == 1:
            self._first_step_end = self.training_time()
        self._unsynced = True
        if self._timed_since is not None:
            self.timing.timed_samples += samples
            self.timing.timed_steps += 1
            self.timing.timed_seconds = self.training_time() - self._timed_since
        elif self._steps_here >= self._warmup():
            self.sync_point()
            # Every rank's clock starts together (the collective is a barrier), none counting a wait; and the
            # slowest rank's warm-up step sets how often the ranks agree on a stop from now on.
            self._stop_every = stop_check_interval(self.runtime, self._steps_here - 1,
                                                   self.training_time() - self._first_step_end)
            self._timed_since = self.training_time()
            self._wait_at_warm = self.train_loader.wait_seconds if self.train_loader else 0.0
        if self.watchdog is not None:
            self.watchdog.beat(self.steps)

    def drew(self) -> None:
        """A training batch was drawn: without warm-up, the clock starts at the first."""
        if self._timed_since is None and self._steps_here == 0 and self._warmup() == 0:
            self._timed_since = self.training_time()

    def _warmup(self) -> int:
        """Warm-up steps; where the run is known to be short, all but its last step at most."""
        if self.total_steps is None:
            return self.warmup_steps
        left = self.total_steps - (self.steps - self._steps_here)  # steps this process runs
        return min(self.warmup_steps, max(0, left - 1))

    def footprint_due(self) -> bool:
        """Measure state bytes before this step: gradients of it, optimiser state of the one before."""
        return self.footprint is None and (self.steps > 0 or self.total_steps == 1)

    # ---------------------------------------------------------------- metrics
    def log(self, values: dict[str, Any], step: int | None, reduce: str | None = "mean",
            kind: str = "step") -> dict[str, Any]:
        """Each value reduced over all ranks (one all-reduce; ``reduce=None``: as given), written by rank 0."""
        if reduce not in (None, "mean", "sum", "max"):
            raise UserError(f"ctx.log(reduce={reduce!r})", "is not a reduction", 'use "mean", "sum", "max" or None')
        if reduce is not None:
            names = sorted(values)
            tensor = torch.tensor([float(_number(values[n])) for n in names], dtype=torch.float64,
                                  device=self.runtime.device)
            if reduce == "sum":
                sum_over_replicas(self.runtime, tensor)
            elif self.runtime.has_process_group:
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX if reduce == "max" else dist.ReduceOp.SUM)
                if reduce == "mean":
                    tensor /= self.runtime.world_size
            values = dict(zip(names, tensor.tolist(), strict=True))
        self.last_values.update(values)
        if self.metrics is not None:
            self.metrics.write({"kind": kind, "step": self.steps if step is None else step, **values})
        return values

    def write(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def _stop_request(self) -> StopRequest:
        return StopRequest(parse_signals(self.cfg.train.stop_signals), self.runtime.has_process_group,
                           self.cfg.strategy.timeout_s)

    def should_stop(self) -> bool:
        """At a step boundary, on every rank. The ranks agree at most every ``_stop_every`` steps (the same
        steps on each), so a stop comes within two agreements (:mod:`nodescale.engine.preemption`)."""
        if self.stop is None:  # created at the first call: a script that never asks keeps the signals' defaults
            self.stop = self._stop_request()
        if self._last_agreement is not None and self.steps - self._last_agreement < self._stop_every:
            return False  # the same answer on every rank: they step together
        self._last_agreement = self.steps
        return self.stop.agreed()

    def stopped(self, code: int) -> None:
        """Rank 0: the stop record, the requeue marker the job script looks for (exit code 3), and a line."""
        if not self.runtime.is_main:
            return
        signal_name = self.stop.signal_name if self.stop else "stop"
        self.write({"kind": "stopped", "step": self.steps, "signal": signal_name, "exit_code": code})
        said = f"{signal_name}: every rank stopped at step {self.steps}, checkpoint written; "
        if code != EXIT_REQUEUE:
            print(f"{said}not requeued (exit code {code}): continue with --out {self.run_dir} --resume", flush=True)
            return
        marker = write_requeue_file(self.steps, self.run_dir)
        print(f"{said}exiting with code {code} for requeue" + (f"; requeue marker {marker}" if marker else ""),
              flush=True)

    # ----------------------------------------------------------------- ending
    def finish(self, summary: bool, model_name: str | None) -> dict[str, Any] | None:
        """Every rank: the summary (a collective) when asked and there is a run directory; close the rest."""
        result = None
        if summary and self.run_dir is not None:
            result = self.summary(model_name)
            if self.runtime.is_main:
                path = self.run_dir / "summary.json"
                with reported(f"{path}", path, "check the file system",
                              "the checkpoints so far are whole, and the run resumes from them"):
                    write_json_atomic(path, result)
            barrier(self.runtime)
        self.close(wait=True, status="finished" if summary else "stopped", summary=result)
        return result

    def summary(self, model_name: str | None) -> dict[str, Any]:
        """The run's summary over all ranks (a collective)."""
        self.sync_point()
        last = self.last_values
        evaluation = EvalResult(last.get("val_loss"), last.get("val_accuracy"), last.get("val_samples"))
        loader, cfg = self.train_loader, self.cfg
        if loader is not None:  # the loader's batch size, not the schema's default
            cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_size": loader.plan.batch_size})})
            self.timing.epoch_seconds = loader.epoch_seconds
            if self._timed_since is not None:
                self.timing.data_wait_seconds = loader.wait_seconds - self._wait_at_warm
        self.timing.includes_warmup = self._warmup() == 0 and self.warmup_steps > 0  # a run too short to leave any out
        position = {"epoch": loader.epoch if loader else 0, "global_step": self.steps}
        result = gather_summary(cfg, self.runtime, self.timing, position, evaluation,
                                peak_memory_bytes(self.runtime.device), self.footprint,
                                time.perf_counter() - self.started)
        if self.library:
            result.update({"model": model_name, "dataset": None})
        if self.work is not None:
            result.update(self.work.summary(result))
        result.update(self.summary_extra)
        if self.cfg.observe.log and self.metrics is not None:  # the loggers' cost (benchmarks/observe_overhead.py)
            result["logger_seconds"] = self.metrics.sink_seconds
        result["run_dir"] = str(self.run_dir)
        if loader is None:
            result["batch_size_per_process"] = result["global_batch_size"] = None
        return result

    def close(self, wait: bool, status: str = "failed", summary: dict[str, Any] | None = None) -> None:
        if self.stop is not None:
            self.stop.close(wait=wait)
            self.stop = None
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.metrics is not None:
            self.metrics.close(summary, status)  # type: ignore[arg-type]
            self.metrics = None
        if self.lock is not None:  # the last: nothing of this run is written after it
            self.lock.release()
            self.lock = None


def _number(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean().item())
    return float(value)
