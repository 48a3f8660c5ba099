"""The library face of nodescale's engine: a few calls make a single-GPU loop distributed::

    ctx = nodescale.init(strategy="fsdp", precision="bf16", seed=0, out="runs/mine")
    model, optimizer = ctx.prepare(model, optimizer)
    for x, y in ctx.loader(train_set, batch_size=32):  # every sample exactly once per epoch
        with ctx.autocast():
            loss = loss_fn(model(x), y)
        ctx.backward(loss)
        ctx.step(optimizer)
    ctx.close()

Strategies, sharding, checkpoints, the stop agreement, the watchdog and the loggers are
``nodescale train``'s, whose loop is written on these calls (``nodescale/train/loop.py``).
A script runs unchanged as ``python script.py``, under ``torchrun``, ``srun`` or ``mpiexec``.
"""

from __future__ import annotations

import random
import time
from contextlib import AbstractContextManager, nullcontext, suppress
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from nodescale.atomic_files import write_atomic
from nodescale.config.strategy import is_strategy_key, strategy_section
from nodescale.data.epoch_loader import DrawnBatch, EpochLoader
from nodescale.data.sharding import ShardPlan
from nodescale.distributed.env import DistEnv, detect
from nodescale.distributed.process_group import Runtime, abandon, barrier, shutdown, start, sum_over_replicas
from nodescale.engine import checkpoints
from nodescale.engine.async_save import BackgroundSaves
from nodescale.engine.optimizer_params import rebind_parameters
from nodescale.engine.run_record import RunRecord
from nodescale.engine.settings import check_process_count, run_config
from nodescale.errors import UserError
from nodescale.models.introspect import unwrap as unwrap_model
from nodescale.stop_signals import EXIT_REQUEUE
from nodescale.strategies import make_strategy
from nodescale.strategies.base import Strategy

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def init(*, strategy: str = "auto", precision: str = "fp32", seed: int | None = None, out: str | Path | None = None,
         grad_accum: int = 1, backend: str = "auto", timeout_s: float = 600.0, **options: Any) -> Context:
    """Join the job this process belongs to, bind it to its device, and set up the engine.

    ``strategy``: ``single``, ``dp``, ``ddp``, ``fsdp`` or ``deepspeed`` (``auto``: ddp with several
    processes, single with one). ``out``: the run directory for metrics, summary and checkpoints
    (nothing is written without it). ``seed`` seeds torch and ``random`` alike on every rank.
    More options (``zero_stage``, ``sharding``, ``log``, ``compile``, ...): docs/library.md.
    """
    started = time.perf_counter()
    env = detect()
    cfg = run_config(env.world_size, out, {"strategy": strategy, "precision": precision, "seed": seed,
                                           "grad_accum": grad_accum, "backend": backend, "timeout_s": timeout_s,
                                           **options})
    check_process_count(cfg.strategy, env, f"nodescale.init(strategy={cfg.strategy.name!r})",
                        "strategy='ddp' (or 'auto')")
    runtime = start(env, cfg.strategy.backend, cfg.strategy.timeout_s, group=cfg.strategy.multi_process,
                    tensor_parallel=getattr(cfg.strategy, "tp", 1))
    if seed is not None:
        torch.manual_seed(seed)
        random.seed(seed)
    return Context(runtime, cfg, started=started)


class Context:
    """This process's place in the job, and the calls that depend on it."""

    def __init__(self, runtime: Runtime, cfg: Any = None, strategy: Strategy | None = None,
                 started: float | None = None, *, library: bool = True) -> None:
        self.runtime = runtime
        self.cfg = cfg if cfg is not None else run_config(runtime.world_size, None, {})
        self.strategy = strategy if strategy is not None else make_strategy(self.cfg.strategy, self.cfg.train.precision)
        self.library = library  # a script's context; else nodescale train's (its own names, --resume rules)
        self.record = RunRecord(self.cfg, runtime, started or time.perf_counter(), library)
        self.prepared: checkpoints.Prepared | None = None
        self.saves = BackgroundSaves(self.record.write)  # records each checkpoint once it is whole
        self.global_step = 0  # optimiser steps taken (ctx.step calls that stepped)
        self._micro = 0  # micro-batches of the current window (without a ctx.loader)
        self._drawn: DrawnBatch | None = None  # the micro-batch last drawn from a ctx.loader
        self._drawn_samples = 0  # real samples drawn since the last optimiser step
        self._sync: AbstractContextManager[None] | None = None  # no_sync of the micro-batch in flight
        self._closed = False
        self._loaders: list[EpochLoader] = []  # their workers stop at close

    def __enter__(self) -> Context:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._closed:  # ctx.close() or ctx.exit_for_requeue() came first
            return
        if exc_type is None:
            self.close()
        else:  # other ranks may never reach a barrier now; leave without one
            self._closed = True
            with suppress(Exception):  # the failure being handled matters more
                self._end_sync()
                self._stop_loaders()
            self.record.close(wait=False)
            abandon(self.runtime)

    # ------------------------------------------------------------- who am I
    @property
    def env(self) -> DistEnv:
        return self.runtime.env

    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def local_rank(self) -> int:
        return self.runtime.env.local_rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def is_main(self) -> bool:
        return self.runtime.is_main

    @property
    def out(self) -> Path | None:
        """The run directory (``init(out=...)``), or None."""
        return self.cfg.out

    # --------------------------------------------------------------- prepare
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                sync_batchnorm: bool = False, **ddp_options: Any) -> Any:
        """The model wrapped by the strategy on this rank's device; ``(model, optimizer)`` with an optimiser.

        The optimiser may be created before: FSDP's new sharded parameters replace the old ones in
        its parameter groups, and DeepSpeed's engine takes it over. Returns what to train and step.
        """
        if self.prepared is not None:
            raise UserError("ctx.prepare called twice", "one context trains one model with one optimiser",
                            "prepare the model and its optimiser together, once")
        sync_batchnorm = sync_batchnorm or getattr(self.cfg.strategy, "sync_batchnorm", False)  # or init's
        updates = {"sync_batchnorm": sync_batchnorm and self.world_size > 1, **ddp_options}
        for name in updates:
            if not is_strategy_key(name):
                raise UserError(f"ctx.prepare({name}=...)", "is not a strategy option",
                                "pass bucket_cap_mb, static_graph, find_unused_parameters or gradient_as_bucket_view")
        self.cfg.strategy = strategy_section({**self.cfg.strategy.model_dump(), **updates})
        self.strategy = make_strategy(self.cfg.strategy, self.cfg.train.precision)
        names = {id(p): name for name, p in model.named_parameters()}
        wrapped = self.strategy.wrap(model, self.runtime)
        updater = None
        if optimizer is not None:
            rebind_parameters(optimizer, names, unwrap_model(wrapped))
            updater = self.strategy.make_updater(wrapped, optimizer, self.cfg)
            wrapped = updater.model  # DeepSpeed's engine, else the wrapped model
        # The state dicts are the uncompiled model's: no "_orig_mod." in a checkpoint's keys.
        runner = torch.compile(wrapped) if self.cfg.train.compile else wrapped
        self.prepared = checkpoints.Prepared(self.strategy, wrapped, optimizer, updater, runner)
        self._begin_micro_batch(self.cfg.train.grad_accum == 1)
        return runner if optimizer is None else (runner, optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside the strategy's wrapper (DDP, DataParallel, torch.compile, DeepSpeed)."""
        return unwrap_model(model)

    # ---------------------------------------------------------------- loader
    def loader(self, dataset: Dataset, batch_size: int, *, shuffle: bool = True, drop_last: bool = False,
               pad: bool = True, seed: int | None = None, **loader_options: Any) -> EpochLoader:
        """This rank's batches of ``dataset``: every sample exactly once per epoch, a new order each epoch.

        ``batch_size`` is per process. ``pad=True`` keeps every rank at the same number of batches
        (training); ``pad=False`` gives each rank only its samples (evaluation with ``ctx.sum``).
        """
        plan = ShardPlan.for_dataset(dataset, self.runtime.data_parallel_size, self.runtime.data_parallel_rank,
                                     batch_size, self.cfg.train.seed if seed is None else seed, shuffle)
        if hasattr(dataset, "stage_shards"):  # --stage: this rank's shards onto node-local disk, first
            dataset.stage_shards(plan)
        loader = EpochLoader(dataset, plan, pad=pad, drop_last=drop_last, grad_accum=self.cfg.train.grad_accum,
                             device=self.device, on_batch=self._drew if pad else None,
                             clock=self.record.synced_time, **loader_options)
        self._loaders.append(loader)
        if pad and self.record.train_loader is None:
            self.record.train_loader = loader  # its batch size and epochs go into the summary
        return loader

    def _drew(self, batch: DrawnBatch) -> None:
        # Training batches only: evaluation runs under no_grad or with the model in eval mode.
        if not torch.is_grad_enabled() or (self.prepared is not None and not self.prepared.model.training):
            return
        self._drawn = batch
        self._drawn_samples += batch.real_count
        self.record.drew()
        self._begin_micro_batch(batch.closes_window)

    def autocast(self) -> AbstractContextManager[Any]:
        """Forward under the run's precision: bf16/fp16 autocast, or nothing for fp32."""
        dtype = _AUTOCAST.get(self.cfg.train.precision)
        return torch.autocast(self.device.type, dtype=dtype) if dtype else nullcontext()

    def untimed(self) -> AbstractContextManager[None]:
        """Time inside (your evaluation, say) is not training time: throughput and epoch times leave it out."""
        return self.record.untimed()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a batch's mean loss, scaled so the step gets the global mean over real samples.

        With a batch from ``ctx.loader``: ``loss * real_count * W / window_total``; otherwise
        ``loss / grad_accum``. fp16 loss scaling and DeepSpeed's backward are the strategy's.
        """
        if self.prepared is None or self.prepared.updater is None:
            raise UserError("ctx.backward", "needs the optimiser", "model, optimizer = ctx.prepare(model, optimizer)")
        drawn = self._drawn
        if drawn is not None:
            scale = drawn.real_count * self.runtime.data_parallel_size / max(drawn.window_total, 1)
        else:
            scale = 1.0 / self.cfg.train.grad_accum
        self.prepared.updater.backward(loss * scale)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor | None:
        """Clip the global gradient norm at a window's end (None between its micro-batches)."""
        if not self._closes_window() or self.prepared is None or self.prepared.updater is None:
            return None
        return self.prepared.updater.clip_grad_norm(max_norm)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Call after every micro-batch's backward: the optimiser steps at a window's end. Returns whether it did."""
        if self.prepared is None or self.prepared.updater is None:
            raise UserError("ctx.step", "needs the optimiser", "model, optimizer = ctx.prepare(model, optimizer)")
        self.saves.poll()  # a background save that failed stops the run here, on every rank
        closes = self._closes_window()
        self._micro += 1
        self._drawn = None
        if not closes:
            self._begin_micro_batch((self._micro + 1) % self.cfg.train.grad_accum == 0)
            return False
        if self.record.footprint_due():
            self.record.footprint = self.strategy.footprint(self.prepared.model, self.prepared.optimizer)
        self.prepared.updater.step()
        self.global_step += 1
        self._micro = 0
        self.record.stepped(self._drawn_samples)
        self._drawn_samples = 0
        self._begin_micro_batch(self.cfg.train.grad_accum == 1)
        return True

    def _closes_window(self) -> bool:
        if self._drawn is not None:
            return self._drawn.closes_window
        return (self._micro + 1) % self.cfg.train.grad_accum == 0

    def _begin_micro_batch(self, closes_window: bool) -> None:
        """Gradient synchronisation on for the micro-batch that closes a window, off before it."""
        self._end_sync()
        if self.prepared is not None and self.prepared.updater is not None:
            self._sync = self.prepared.updater.accumulating(closes_window)
            self._sync.__enter__()

    def _end_sync(self) -> None:
        if self._sync is not None:
            sync, self._sync = self._sync, None
            sync.__exit__(None, None, None)

    # -------------------------------------------------- logs and checkpoints
    def log(self, values: dict[str, Any], step: int | None = None, *, reduce: str | None = "mean",
            kind: str = "step") -> dict[str, Any]:
        """Each value reduced over ranks (``"mean"``, ``"sum"``, ``"max"``; None: the same on every rank
        already), into metrics.jsonl/csv and the loggers as a ``kind`` record (a collective)."""
        return self.record.log(values, self.global_step if step is None else step, reduce, kind)

    def save_checkpoint(self, state: dict[str, Any], step: int | None = None, *,
                        background: bool | None = None) -> Path:
        """Every rank: checkpoint ``state`` (the prepared model and optimiser, loaders, schedulers, values).
        ``background`` (default: init's ``checkpoint_async``): return once the state is in host memory, the files
        written while training goes on (the next save, ``close`` and a requeue exit wait for them)."""
        step = int(state.get("step", self.global_step)) if step is None else step
        with self.record.untimed():
            return checkpoints.save(state, step, self.runtime, self.cfg, self.prepared, self.saves, self.library,
                                    self.cfg.checkpoint.async_save if background is None else background)

    def load_checkpoint(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Every rank: load the newest whole checkpoint into ``state``'s objects; its values, or None."""
        expected = None if self.library else self.cfg.model_dump(mode="json")
        self.saves.wait()
        loaded = checkpoints.load(state, self.runtime, self.prepared, checkpoints.run_dir(self.cfg, "load"),
                                  expected)
        if loaded is not None:
            self.global_step = self.record.steps = int(loaded["step"])
            if self.library and self.is_main:
                print(f"nodescale: resumed from {loaded['path']} (step {self.global_step})", flush=True)
        return loaded

    def should_stop(self) -> bool:
        """At a step boundary, on every rank: whether a stop signal (SIGTERM, ...) reached any rank."""
        return self.record.should_stop()

    def exit_for_requeue(self) -> None:
        """After the stop's checkpoint: the requeue marker, a clean exit, exit code 3 (``nodescale train``
        without ``--resume``: 1, since its requeued job would not continue)."""
        self.saves.wait()  # the stop's checkpoint whole before the requeue marker
        code = EXIT_REQUEUE if self.library or self.cfg.checkpoint.resume else 1
        self.record.stopped(code)
        self.close(summary=False)
        raise SystemExit(code)

    def _stop_loaders(self) -> None:
        for loader in self._loaders:
            loader.close()

    # ------------------------------------------------------ today's helpers
    def mean(self, value: float | torch.Tensor) -> float:
        """The mean of ``value`` over all ranks (a collective: every rank must call it)."""
        return self.sum(value) / self.runtime.data_parallel_size

    def sum(self, value: float | torch.Tensor) -> float:
        """The sum of ``value`` over all ranks (a collective), a tensor-parallel group's counted once (--tp)."""
        tensor = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach().clone()
        return float(sum_over_replicas(self.runtime, tensor))

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        barrier(self.runtime)

    def save(self, path: str | Path, obj: Any) -> None:
        """``torch.save`` from rank 0 only, atomically; every rank waits until it is written."""
        if self.is_main:
            write_atomic(Path(path), lambda handle: torch.save(obj, handle))
        self.barrier()

    def load(self, path: str | Path, *, weights_only: bool = True) -> Any:
        """``torch.load`` onto this rank's device."""
        return torch.load(path, map_location=self.device, weights_only=weights_only)

    def close(self, *, summary: bool = True) -> dict[str, Any] | None:
        """Write summary.json (with ``out=``) and leave the process group cleanly; every rank calls it."""
        if self._closed:
            return None
        self.saves.wait()  # before _closed: a failed save leaves through __exit__'s abandon
        self._closed = True
        self._end_sync()
        self._stop_loaders()
        name = checkpoints.model_name(self.prepared.model) if self.prepared else None
        result = self.record.finish(summary, name)
        self.prepared = None  # the wrappers' references go before the group does
        shutdown(self.runtime)
        return result
