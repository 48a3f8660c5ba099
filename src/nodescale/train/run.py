"""One rank's whole run: process group, data, model, strategy, training, summary.

Called in every worker process, whoever started it: nodescale's own local
launcher, torchrun, srun or mpiexec (``nodescale.distributed.env`` tells them apart).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nodescale.api import Context
from nodescale.config.schema import RunConfig
from nodescale.data.pipeline import input_pipeline
from nodescale.data.registry import get_format
from nodescale.distributed.env import DistEnv, detect
from nodescale.distributed.process_group import Runtime, barrier, start
from nodescale.engine.settings import check_process_count
from nodescale.engine.summary import summary_table
from nodescale.launch.schedulers.local_launcher import current_restart
from nodescale.models.activation_checkpointing import apply_activation_checkpointing
from nodescale.strategies import make_strategy
from nodescale.train.build_model import build_for_run
from nodescale.train.collective_faults import LeftAfterCollectiveFault, end_process_now, explain
from nodescale.train.console import Console
from nodescale.train.loop import train
from nodescale.train.loss import make_loss
from nodescale.train.math_settings import configure_math
from nodescale.train.observers import Observers
from nodescale.train.optim import make_optimizer, make_scheduler
from nodescale.train.rundir import check_run_dir, default_run_dir
from nodescale.train.work import describe, language_model_work


def run_training(cfg: RunConfig, env: DistEnv | None = None) -> dict[str, Any]:
    """Train as one rank of the job described by ``env`` (detected if omitted); return the summary.

    On an agreed stop signal (``train.stop_signals``) every rank checkpoints the step and leaves
    with ``SystemExit(EXIT_REQUEUE)`` once the process group is shut down.
    """
    started = time.perf_counter()
    env = env or detect()
    strategy = make_strategy(cfg.strategy, cfg.train.precision)
    check_process_count(cfg.strategy, env, f"strategy {cfg.strategy.name!r}", "--strategy ddp")
    runtime = start(env, cfg.strategy.backend, cfg.strategy.timeout_s, group=cfg.strategy.multi_process,
                    tensor_parallel=getattr(cfg.strategy, "tp", 1))
    cfg = _resume_after_restart(cfg.model_copy(update={"out": _agree_run_dir(cfg, runtime)}))
    # Before anything slow: the stop handlers (a signal during start-up is kept until the first
    # step boundary) and the watchdog.
    ctx = Context(runtime, cfg, strategy, started, library=False)
    observers = Observers(cfg, runtime, cfg.out)
    try:
        return _train(ctx, observers)
    except BaseException as exc:  # ctx.exit_for_requeue's SystemExit too: the context is closed then
        observers.abort()
        ctx.__exit__(type(exc), exc, None)  # another rank may never reach a barrier now: leave without one
        # Start-up's collectives (DDP's first broadcast, a resume's agreement) as the steps' ones.
        fault = explain(exc, runtime.rank, ctx.global_step, cfg.strategy.timeout_s)
        if fault is not None:  # another rank's fault: say so, without this rank's traceback
            print(fault.message, file=sys.stderr, flush=True)
            raise LeftAfterCollectiveFault(fault.exit_code) from None
        raise


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


def _agree_run_dir(cfg: RunConfig, runtime: Runtime) -> Path:
    chosen = [str(cfg.out or default_run_dir(cfg))]
    if runtime.has_process_group and cfg.out is None:
        dist.broadcast_object_list(chosen, src=0)  # ranks' clocks may straddle a second
    return Path(chosen[0])


def _train(ctx: Context, observers: Observers) -> dict[str, Any]:
    cfg, runtime, run_dir = ctx.cfg, ctx.runtime, ctx.out
    if runtime.is_main:
        check_run_dir(run_dir, cfg.checkpoint.resume)
        run_dir.mkdir(parents=True, exist_ok=True)
    console = Console(runtime.is_main, cfg.train.progress)
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
    ctx.record.work = language_model_work(model, spec, cfg.train.precision, runtime.device)  # before any wrapper
    channels_last = cfg.train.channels_last and spec.is_image
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model, cfg.model.name, cfg.strategy.fsdp_units)
    optimizer = make_optimizer(cfg.optim, model, runtime.device)
    model, optimizer = ctx.prepare(model, optimizer)

    batch, data = cfg.train.batch_size, input_pipeline(cfg.data, splits, runtime, cfg.train.seed)
    pool = {"num_workers": data.workers, "prefetch_factor": 4} if data.workers else {}
    loader = ctx.loader(data.train, batch, shuffle=cfg.data.order == "shuffled", channels_last=channels_last,
                        **({**pool, "persistent_workers": True} if data.workers else {}), **data.train_options)
    # Validation workers start per evaluation rather than idling beside the training ones.
    val_loader = ctx.loader(data.val, batch, shuffle=False, channels_last=channels_last, **pool, **data.val_options)
    steps_per_epoch = -(-len(loader) // cfg.train.grad_accum)
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    scheduler = make_scheduler(cfg.optim, optimizer, total_steps)
    console.print(f"nodescale: {cfg.model.name} on {cfg.data.name} ({len(splits.train)} train / {len(splits.val)} "
                  f"val), {cfg.strategy.name} x {runtime.world_size} on {runtime.device.type}, {total_steps} steps "
                  f"-> {run_dir}")
    if ctx.record.work is not None:
        console.print(describe(ctx.record.work))
    if cfg.checkpoint.resume:
        _resume(ctx, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}, console)
    ctx.record.total_steps = total_steps
    ctx.record.open(resumed=ctx.global_step > 0)  # after a resume was accepted: a refused one leaves the settings

    profiler = observers.start(ctx.global_step)
    evaluation = train(ctx, cfg, model, optimizer, scheduler, loader, val_loader,
                       make_loss(cfg.train.loss, spec.task), spec.task, total_steps, console, profiler)
    ctx.record.last_values.update(val_loss=evaluation.loss, val_accuracy=evaluation.accuracy,
                                  val_samples=evaluation.samples)
    ctx.record.summary_extra.update(observers.stop(console))
    del model, optimizer, scheduler  # the wrappers' references go before the group does
    summary = ctx.close()
    assert summary is not None
    console.print(summary_table(summary))
    return summary


def _resume_after_restart(cfg: RunConfig) -> RunConfig:
    """A worker of a restarted group (a rank failed; ``--max-restarts``) continues the run: it resumes."""
    if current_restart() is None or cfg.checkpoint.resume:
        return cfg
    return cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})


def _resume(ctx: Context, state: dict[str, Any], console: Console) -> None:
    restart = current_restart()
    # Every rank takes part: they share the checksums of the candidates and agree on one.
    loaded = ctx.load_checkpoint(state)
    if loaded is None:
        begin = f"{restart.describe()}: " if restart else "--resume: "
        console.note(f"{begin}no checkpoint in {ctx.out}; starting from scratch")
    elif restart:
        console.note(f"{restart.describe()}: resuming from {Path(loaded['path']).name} (step {ctx.global_step})")
    else:
        console.note(f"resumed from {loaded['path']} (step {ctx.global_step})")
