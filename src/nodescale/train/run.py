"""One rank's whole run: process group, data, model, strategy, training, summary.

Called in every worker process, whoever started it: nodescale's own local
launcher, torchrun, srun or mpiexec (``nodescale.dist.env`` tells them apart).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nodescale.atomic_files import write_json_atomic, write_text_atomic
from nodescale.config.load import dump_yaml
from nodescale.config.schema import RunConfig
from nodescale.data.loader import StepLoader
from nodescale.data.registry import get_format
from nodescale.data.sharding import ShardPlan
from nodescale.dist.env import DistEnv, detect
from nodescale.dist.local_launch import current_restart
from nodescale.dist.process_group import Runtime, abandon, barrier, shutdown, start
from nodescale.dist.watchdog import Watchdog, start_watchdog
from nodescale.errors import UserError
from nodescale.models.activation_checkpointing import apply_activation_checkpointing
from nodescale.observe.loggers import make_sinks
from nodescale.plugins.build import build_for_run
from nodescale.strategies import make_strategy
from nodescale.train import checkpoint
from nodescale.train.backends import configure_math
from nodescale.train.collective_faults import CollectiveFault, LeftAfterCollectiveFault, end_process_now, explain
from nodescale.train.console import Console
from nodescale.train.metrics_log import MetricsLog
from nodescale.train.observers import Observers
from nodescale.train.optim import make_optimizer, make_scheduler
from nodescale.train.preemption import StopRequest, write_requeue_file
from nodescale.train.rundir import check_run_dir, default_run_dir
from nodescale.train.stop_signals import EXIT_REQUEUE, parse_signals
from nodescale.train.summary import gather_summary, summary_table
from nodescale.train.trainer import Trainer


def run_training(cfg: RunConfig, env: DistEnv | None = None) -> dict[str, Any]:
    """Train as one rank of the job described by ``env`` (detected if omitted); return the summary.

    On an agreed stop signal (``train.stop_signals``) every rank checkpoints the step and leaves
    with ``SystemExit(EXIT_REQUEUE)`` once the process group is shut down.
    """
    started = time.perf_counter()
    env = env or detect()
    strategy = make_strategy(cfg.strategy, cfg.train.precision)
    if env.world_size > 1 and not strategy.needs_process_group:
        raise UserError(
            f"strategy {cfg.strategy.name!r} under a launcher that started {env.world_size} processes ({env.source})",
            f"{cfg.strategy.name} runs in a single process",
            "use --strategy ddp, or launch one process",
        )
    runtime = start(env, cfg.strategy.backend, cfg.strategy.timeout_s, group=strategy.needs_process_group)
    # Before anything slow: a signal during start-up is kept until the first step boundary.
    stop = StopRequest(parse_signals(cfg.train.stop_signals), runtime.distributed, cfg.strategy.timeout_s)
    watchdog = start_watchdog(runtime, cfg.train.heartbeat_timeout_s)
    try:
        summary = _train(cfg, runtime, strategy, started, stop, watchdog)
    except BaseException as exc:
        # Another rank may never reach a barrier now: leave without one.
        stop.close(wait=False)
        if watchdog is not None:
            watchdog.stop()
        abandon(runtime)
        if isinstance(exc, CollectiveFault):  # another rank's fault: say so, without this rank's traceback
            print(exc.message, file=sys.stderr, flush=True)
            raise LeftAfterCollectiveFault(exc.exit_code) from None
        raise
    stop.close()
    if watchdog is not None:
        watchdog.stop()
    shutdown(runtime)
    if summary.get("stopped_by"):
        raise SystemExit(summary["exit_code"])
    return summary


def run_training_as_worker(cfg: RunConfig, env: DistEnv | None = None) -> dict[str, Any]:
    """:func:`run_training` in a process that exists for this run alone (a launcher's worker).

    After a collective fault it ends the process at once with the fault's exit code
    (:func:`~nodescale.train.collective_faults.end_process_now`); a library caller of
    :func:`run_training` gets :class:`LeftAfterCollectiveFault` instead.
    """
    try:
        return run_training(cfg, env)
    except LeftAfterCollectiveFault as exc:
        end_process_now(int(exc.code or 1))


def _leave_for_requeue(trainer: Trainer, runtime: Runtime, metrics: MetricsLog, console: Console) -> dict[str, Any]:
    """After the agreed stop's checkpoint: say so, leave the requeue marker, pick the exit code."""
    cfg, step = trainer.cfg, trainer.position.global_step
    resumable = cfg.checkpoint.resume
    code = EXIT_REQUEUE if resumable else 1
    if runtime.is_main:
        metrics.write({"kind": "stopped", "step": step, "signal": trainer.stopped_by, "exit_code": code})
        if resumable:
            marker = write_requeue_file(trainer.run_dir)
            where = f"; requeue marker {marker}" if marker else ""
            console.note(f"{trainer.stopped_by}: every rank stopped at step {step}, checkpoint written; "
                         f"exiting with code {code} for requeue{where}")
        else:
            console.note(f"{trainer.stopped_by}: every rank stopped at step {step}, checkpoint written; not "
                         f"requeued (exit code {code}): continue with --out {trainer.run_dir} --resume")
    metrics.close(None, "stopped")
    return {"stopped_by": trainer.stopped_by, "exit_code": code, "global_step": step,
            "run_dir": str(trainer.run_dir)}


def _agree_run_dir(cfg: RunConfig, runtime: Runtime) -> Path:
    chosen = [str(cfg.out or default_run_dir(cfg))]
    if runtime.distributed and cfg.out is None:
        dist.broadcast_object_list(chosen, src=0)  # ranks' clocks may straddle a second
    return Path(chosen[0])


def _train(cfg: RunConfig, runtime: Runtime, strategy: Any, started: float, stop: StopRequest | None = None,
           watchdog: Watchdog | None = None) -> dict[str, Any]:
    run_dir = _agree_run_dir(cfg, runtime)
    cfg = _resume_after_restart(cfg.model_copy(update={"out": run_dir}))
    if runtime.is_main:
        check_run_dir(run_dir, cfg.checkpoint.resume)
        run_dir.mkdir(parents=True, exist_ok=True)
    console = Console(runtime.is_main, cfg.train.progress)
    sinks = make_sinks(cfg.observe, run_dir) if runtime.is_main else []
    metrics = MetricsLog(run_dir / "metrics.jsonl", runtime.is_main, sinks)
    observers = Observers(cfg, runtime, run_dir)
    with _closed_on_failure(metrics, observers):
        configure_math(cfg.train, runtime.device)  # cuDNN autotuning and TF32, before any model exists
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        random.seed(cfg.train.seed)
        data_format = get_format(cfg.data.name)
        if runtime.is_local_main:  # one process per node prepares; the others wait
            data_format.prepare(cfg.data)
        barrier(runtime)
        splits = data_format.load(cfg.data, cfg.train.seed)

        # The user's model, data or loss (FILE.py:FN) are checked here, on every rank alike.
        model, spec = build_for_run(cfg, splits)
        channels_last = cfg.train.channels_last and spec.is_image
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        if cfg.train.activation_checkpointing:
            apply_activation_checkpointing(model, cfg.model.name, cfg.strategy.fsdp_units)
        wrapped = strategy.wrap(model, runtime)
        optimizer = make_optimizer(cfg.optim, wrapped, runtime.device)
        updater = strategy.make_updater(wrapped, optimizer, cfg)
        runner = torch.compile(updater.model) if cfg.train.compile else updater.model

        world, rank, batch = runtime.world_size, runtime.rank, cfg.train.batch_size
        train_plan = ShardPlan(len(splits.train), world, rank, batch, cfg.train.seed, shuffle=True)
        val_plan = ShardPlan(len(splits.val), world, rank, batch, cfg.train.seed, shuffle=False)
        workers = cfg.data.num_workers
        train_loader = StepLoader(splits.train, train_plan, runtime.device, workers, channels_last)
        # Validation workers start per evaluation rather than idling beside the training ones.
        val_loader = StepLoader(splits.val, val_plan, runtime.device, workers, channels_last, persistent_workers=False)

        steps_per_epoch = -(-train_plan.steps_per_epoch // cfg.train.grad_accum)
        total_steps = cfg.train.epochs * steps_per_epoch
        if cfg.train.max_steps:
            total_steps = min(total_steps, cfg.train.max_steps)
        scheduler = make_scheduler(cfg.optim, optimizer, total_steps)
        trainer = Trainer(cfg, runtime, strategy, updater, runner, optimizer, scheduler, train_loader, val_loader,
                          spec.task, run_dir, console, metrics)
        if runtime.is_main:
            console.print(
                f"nodescale: {cfg.model.name} on {cfg.data.name} ({len(splits.train)} train / {len(splits.val)} val), "
                f"{cfg.strategy.name} x {world} on {runtime.device.type}, {total_steps} steps -> {run_dir}"
            )
        if cfg.checkpoint.resume:
            _resume(trainer, run_dir, console)
        if runtime.is_main:  # after a resume was accepted: a refused one leaves the run's own settings
            write_text_atomic(run_dir / "config.yaml", dump_yaml(cfg))
        metrics.start(cfg.model_dump(mode="json"), resumed=trainer.position.global_step > 0)

        trainer.stop, trainer.watchdog = stop, watchdog
        observers.start(trainer)
        try:
            trainer.fit()
        except RuntimeError as exc:
            fault = explain(exc, runtime.rank, trainer.position.global_step, cfg.strategy.timeout_s)
            if fault is None:
                raise
            raise fault from exc
        observed = observers.stop(console)
        if trainer.stopped_by:
            return _leave_for_requeue(trainer, runtime, metrics, console)
        summary = gather_summary(cfg, runtime, trainer.timing, trainer.position.as_dict(), trainer.last_eval,
                                 trainer.peak_memory(), trainer.footprint, time.perf_counter() - started)
        summary.update(observed)
        if cfg.observe.log:  # what the loggers cost rank 0 (metrics.csv included), for benchmarks/observe_overhead.py
            summary["logger_seconds"] = metrics.sink_seconds
        summary["run_dir"] = str(run_dir)
        if runtime.is_main:
            write_json_atomic(run_dir / "summary.json", summary)
            console.print(summary_table(summary))
        metrics.close(summary, "finished")
        return summary


@contextmanager
def _closed_on_failure(metrics: MetricsLog, observers: Observers) -> Iterator[None]:
    """On any failure: stop the sampler and the profiler, and close the loggers' runs as failed."""
    try:
        yield
    except BaseException:
        observers.abort()
        metrics.close(None, "failed")
        raise


def _resume_after_restart(cfg: RunConfig) -> RunConfig:
    """A worker of a restarted group (a rank failed; ``--max-restarts``) continues the run: it resumes."""
    if current_restart() is None or cfg.checkpoint.resume:
        return cfg
    return cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})


def _resume(trainer: Trainer, run_dir: Path, console: Console) -> None:
    restart = current_restart()
    # Every rank takes part: they share the checksums of the candidates and agree on one.
    found = checkpoint.load_newest(run_dir, collective=True)
    if found is None:
        start = f"{restart.describe()}: " if restart else "--resume: "
        console.note(f"{start}no checkpoint in {run_dir}; starting from scratch")
        return
    state, path = found
    checkpoint.check_compatible(state, trainer.cfg.model_dump(mode="json"), path)
    try:
        trainer.load_state_dict(state, path)
    except (RuntimeError, KeyError, ValueError) as exc:  # shapes or optimiser groups that do not fit
        first_line = str(exc).strip().splitlines()[0]
        raise UserError(f"--resume from {path}", f"the checkpoint does not fit this run ({first_line})",
                        "resume with the settings the run was started with, or use another --out") from None
    if restart:
        console.note(f"{restart.describe()}: resuming from {path.name} (step {trainer.position.global_step})")
    else:
        console.note(f"resumed from {path} (step {trainer.position.global_step})")
