"""What a library script's run leaves behind, as ``nodescale train`` does: metrics, summary, stop, heartbeat.

With ``out=`` a run directory gets ``config.yaml``, ``metrics.jsonl``/``metrics.csv`` (and the
chosen loggers) from ``ctx.log``, and ``summary.json`` at ``ctx.close()``. Throughput counts
the real samples every rank drew from ``ctx.loader`` after the warm-up steps, over the
slowest rank's time from the end of warm-up to the last optimiser step, synchronised on the
device, with checkpoint saves excluded. Without ``out=`` nothing is written.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nodescale.atomic_files import write_json_atomic, write_text_atomic
from nodescale.config.load import dump_yaml
from nodescale.config.schema import RunConfig
from nodescale.data.epoch_loader import EpochLoader
from nodescale.dist.process_group import Runtime, barrier
from nodescale.dist.watchdog import start_watchdog
from nodescale.observe.loggers import make_sinks
from nodescale.strategies.base import Footprint
from nodescale.train.clock import peak_memory_bytes, synchronize
from nodescale.train.evaluate import EvalResult
from nodescale.train.metrics_log import MetricsLog
from nodescale.train.preemption import StopRequest, write_requeue_file
from nodescale.train.stop_signals import EXIT_REQUEUE, parse_signals
from nodescale.train.trainer import Timing


class RunRecord:
    """One library run's files, clocks, stop agreement and heartbeat."""

    def __init__(self, cfg: RunConfig, runtime: Runtime, started: float) -> None:
        self.cfg, self.runtime, self.started = cfg, runtime, started
        self.run_dir: Path | None = cfg.out
        self.metrics: MetricsLog | None = None
        if self.run_dir is not None:
            if runtime.is_main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                write_text_atomic(self.run_dir / "config.yaml", dump_yaml(cfg))
            sinks = make_sinks(cfg.observe, self.run_dir) if runtime.is_main else []
            self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", runtime.is_main, sinks)
            resumed = (self.run_dir / "checkpoints").is_dir()
            self.metrics.start(cfg.model_dump(mode="json"), resumed=resumed)
        self.watchdog = start_watchdog(runtime, cfg.train.heartbeat_timeout_s)
        self.stop: StopRequest | None = None
        self.timing = Timing()
        self.steps = 0
        self.footprint: Footprint | None = None
        self.train_loader: EpochLoader | None = None
        self.last_values: dict[str, float] = {}
        self._timed_since: float | None = None
        self._excluded = 0.0

    # ------------------------------------------------------------------ steps
    def stepped(self, samples: int) -> None:
        """An optimiser step ended, with ``samples`` real samples drawn since the one before."""
        self.steps += 1
        if self._timed_since is not None:
            self.timing.timed_samples += samples
            self.timing.timed_steps += 1
            self.timing.timed_seconds = time.perf_counter() - self._timed_since - self._excluded
        elif self.steps >= self.cfg.train.timing_warmup_steps:
            synchronize(self.runtime.device)
            self._timed_since = time.perf_counter()
        if self.watchdog is not None:
            self.watchdog.beat(self.steps)

    def excluded(self, seconds: float) -> None:
        """Time spent saving checkpoints: not training."""
        if self._timed_since is not None:
            self._excluded += seconds

    # ---------------------------------------------------------------- metrics
    def log(self, values: dict[str, Any], step: int | None) -> dict[str, float]:
        """The mean of each value over all ranks (one all-reduce), written by rank 0."""
        names = sorted(values)
        tensor = torch.tensor([float(_number(values[n])) for n in names], dtype=torch.float64,
                              device=self.runtime.device)
        if self.runtime.distributed:
            dist.all_reduce(tensor)
            tensor /= self.runtime.world_size
        means = dict(zip(names, tensor.tolist(), strict=True))
        self.last_values.update(means)
        if self.metrics is not None:
            self.metrics.write({"kind": "step", "step": self.steps if step is None else step, **means})
        return means

    def should_stop(self) -> bool:
        if self.stop is None:  # created at the first call: a script that never asks keeps the signals' defaults
            self.stop = StopRequest(parse_signals(self.cfg.train.stop_signals), self.runtime.distributed,
                                    self.cfg.strategy.timeout_s)
        return self.stop.agreed()

    def requeue_marker(self) -> Path | None:
        """Rank 0: the stop record and the requeue marker the job script looks for."""
        if not self.runtime.is_main:
            return None
        signal_name = self.stop.signal_name if self.stop else "none"
        if self.metrics is not None:
            self.metrics.write({"kind": "stopped", "step": self.steps, "signal": signal_name,
                                "exit_code": EXIT_REQUEUE})
        return write_requeue_file(self.run_dir) if self.run_dir is not None else None

    # ----------------------------------------------------------------- ending
    def finish(self, summary: bool, model_name: str | None) -> dict[str, Any] | None:
        """Every rank: the summary (a collective) when asked and there is a run directory; close the rest."""
        result = None
        if summary and self.run_dir is not None:
            from nodescale.train.summary import gather_summary

            last = self.last_values
            evaluation = EvalResult(last.get("val_loss"), last.get("val_accuracy"), None)  # type: ignore[arg-type]
            loader = self.train_loader
            cfg = self.cfg
            if loader is not None:  # the loader's batch size, not the schema's default
                train = cfg.train.model_copy(update={"batch_size": loader.plan.batch_size})
                cfg = cfg.model_copy(update={"train": train})
            position = {"epoch": loader.epoch if loader else 0, "global_step": self.steps}
            result = gather_summary(cfg, self.runtime, self.timing, position, evaluation,
                                    peak_memory_bytes(self.runtime.device), self.footprint,
                                    time.perf_counter() - self.started)
            result.update({"model": model_name, "dataset": None, "run_dir": str(self.run_dir)})
            if loader is None:
                result["batch_size_per_process"] = result["global_batch_size"] = None
            if self.runtime.is_main:
                write_json_atomic(self.run_dir / "summary.json", result)
            barrier(self.runtime)
        self.close(wait=True, status="finished" if summary else "stopped", summary=result)
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


def _number(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean().item())
    return float(value)
