"""``ctx.save_checkpoint`` and ``ctx.load_checkpoint``: whatever a script names, in nodescale's checkpoints.

The prepared model and optimiser go through the strategy (a full state dict gathered on
rank 0, or every rank's shards through torch.distributed.checkpoint or DeepSpeed), so
they resume on any world size the strategy supports and ``nodescale checkpoint export``
reads them. Everything else the dict names is kept beside them: objects with
``state_dict``/``load_state_dict`` (loaders, LR schedulers, other modules) by their
state, plain values as they are. Files, manifests, atomicity and the choice of the
newest whole checkpoint are ``nodescale.engine.checkpoint_files``'s, as for ``nodescale train``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nodescale.config.schema import RunConfig
from nodescale.data.epoch_loader import EpochLoader
from nodescale.distributed.process_group import Runtime, barrier, gather_from_all
from nodescale.engine import async_save, checkpoint_files, checkpoint_stage, disk_space
from nodescale.engine.async_save import BackgroundSaves
from nodescale.errors import UserError
from nodescale.strategies.base import Strategy, Updater


@dataclass
class Prepared:
    """What ``ctx.prepare`` made: the strategy's wrapped model, its optimiser and updater."""

    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    updater: Updater | None
    runner: nn.Module  # what the script calls: the model, or its torch.compile form


def _split(items: dict[str, Any], prepared: Prepared | None) -> tuple[str | None, str | None, dict, dict]:
    """(model key, optimiser key, stateful objects, plain values) of a checkpoint dict."""
    model_key = optimizer_key = None
    stateful: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for key, value in items.items():
        if prepared is not None and (value is prepared.model or value is prepared.runner):
            model_key = key
        elif prepared is not None and prepared.optimizer is not None and value is prepared.optimizer:
            optimizer_key = key
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            stateful[key] = value
        else:
            values[key] = value
    return model_key, optimizer_key, stateful, values


def save(items: dict[str, Any], step: int, runtime: Runtime, cfg: RunConfig, prepared: Prepared | None,
         saves: BackgroundSaves, library: bool = True, background: bool = False) -> Path:
    """Every rank: write checkpoint ``step`` of ``items`` into init's ``out`` (a collective); returns its path.

    ``library``: the settings record the script's model and optimiser classes (``nodescale
    train``'s name its built-in or plugin model and dataset already). A save that runs out of
    disk space or quota is a :class:`UserError` naming the newest whole checkpoint. The save in
    flight in ``saves`` is waited for first; with ``background``, this one returns once the state
    is in host memory and is written there (``nodescale.engine.async_save``), its errors raised
    by ``saves``.
    """
    directory = run_dir(cfg, "save")
    saves.wait()  # one save in flight at a time
    if runtime.is_main:
        disk_space.warn_if_short(directory, step)
    written_to = directory if cfg.checkpoint.stage is None else _stage(cfg, runtime, prepared, saves, directory)
    try:
        path = _write(items, step, runtime, cfg, prepared, written_to, library, saves if background else None)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        reported = disk_space.as_full_error(error, written_to, step, runtime.is_main)
        if reported is error:
            raise
        raise reported from error
    if written_to != directory:
        if not background:
            saves.start(step, lambda: path)  # written: only the copy into the run directory runs behind
        return checkpoint_stage.run_dir_path(path, directory)
    if not background:
        saves.published(step, path)
    return path


def _stage(cfg: RunConfig, runtime: Runtime, prepared: Prepared | None, saves: BackgroundSaves,
           directory: Path) -> Path:
    """Every rank, before a staged save (``--checkpoint-stage``): where it writes; the copy that follows it."""
    stage = cfg.checkpoint.stage
    assert stage is not None
    sharded = prepared is not None and checkpoint_files.is_sharded_format(cfg.checkpoint.format,
                                                                          prepared.strategy.shards_state)
    checkpoint_stage.check_one_node(runtime.env.num_nodes, sharded, stage)
    group = saves.group()  # a collective, on the training thread: the copy's agreement runs in the background
    saves.after = checkpoint_stage.copier(
        directory, cfg.checkpoint.keep_last, runtime.is_main, lambda error, step: async_save.agree(error, group, step),
        lambda error, step: disk_space.as_full_error(error, directory, step, runtime.is_main))
    return checkpoint_stage.staged_run_dir(stage, directory)


def _write(items: dict[str, Any], step: int, runtime: Runtime, cfg: RunConfig, prepared: Prepared | None,
           run_dir: Path, library: bool, background: BackgroundSaves | None) -> Path:
    model_key, optimizer_key, stateful, values = _split(items, prepared)
    _check_named(model_key, optimizer_key, prepared, "ctx.save_checkpoint")
    loader = next((v for v in stateful.values() if isinstance(v, EpochLoader)), None)
    position = {"epoch": loader.epoch if loader else 0, "batch_in_epoch": loader.batch_in_epoch if loader else 0,
                "global_step": step}
    config = cfg.model_dump(mode="json")
    if library:
        if prepared is not None:
            config["model"]["name"] = model_name(prepared.model)
            config["optim"]["name"] = type(prepared.optimizer).__name__.lower()
        config["data"]["name"] = None
    state: dict[str, Any] = {
        "api": {"model_key": model_key, "optimizer_key": optimizer_key, "values": values,
                "stateful": {key: value.state_dict() for key, value in stateful.items()}},
        "updater": prepared.updater.state_dict() if prepared and prepared.updater else {},
        "position": position,
        "world_size": runtime.world_size,
        "batch_size": loader.plan.batch_size if loader else None,
        "rng": gather_from_all(runtime, checkpoint_files.rng_state(runtime.device)),  # a collective
        "config": config,
    }
    keep = cfg.checkpoint.keep_last
    if prepared is not None and checkpoint_files.is_sharded_format(cfg.checkpoint.format,
                                                                   prepared.strategy.shards_state):
        state["layout"] = prepared.strategy.sharded_layout
        if background is not None:
            return async_save.start_sharded(
                background, run_dir, step, runtime,
                lambda directory, group: prepared.strategy.save_sharded_async(prepared.model, prepared.optimizer,
                                                                              directory, group), state, keep)
        return checkpoint_files.write_sharded(
            run_dir, step, runtime.is_main, lambda: barrier(runtime),
            lambda directory: prepared.strategy.save_sharded(prepared.model, prepared.optimizer, directory),
            lambda: state, keep)
    if prepared is not None:
        state.update(prepared.strategy.state_dict(prepared.model, prepared.optimizer))  # a collective
    if background is not None:
        return async_save.start_full(background, run_dir, step, runtime, state, keep)
    path = checkpoint_files.checkpoint_path(run_dir, step)
    if runtime.is_main:
        checkpoint_files.save(run_dir, step, state, keep)
    barrier(runtime)  # nobody reads the checkpoint (or leaves) before it is there
    return path


def run_dir(cfg: RunConfig, what: str) -> Path:
    """The run directory ``ctx.{what}_checkpoint`` uses: init's ``out``."""
    if cfg.out is None:
        raise UserError(f"ctx.{what}_checkpoint", "needs a run directory", 'nodescale.init(out="runs/my-run")')
    return cfg.out


def load(items: dict[str, Any], runtime: Runtime, prepared: Prepared | None, run_dir: Path,
         expected: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Every rank: load the newest whole checkpoint into ``items``; its plain values, or None if there is none.

    ``expected``: the settings of a ``nodescale train`` run, which the checkpoint's must match
    (its errors then speak of ``--resume``)."""
    found = checkpoint_files.load_newest(run_dir, collective=runtime.has_process_group)
    if found is None:
        return None
    state, path = found
    what = f"checkpoint {path}" if expected is None else f"--resume from {path}"
    if expected is not None:
        checkpoint_files.check_compatible(state, expected, path)
    saved = state["api"] if "api" in state else _from_trainer(state)
    model_key, optimizer_key, stateful, _ = _split(items, prepared)
    _check_named(model_key, optimizer_key, prepared, "ctx.load_checkpoint")
    try:
        if prepared is not None:
            if "model" in state:
                prepared.strategy.load_state_dict(prepared.model, prepared.optimizer, state)
            else:
                _check_layout(state, prepared.strategy, what)
                prepared.strategy.load_sharded(prepared.model, prepared.optimizer, path)
            if prepared.updater is not None and state.get("updater"):
                prepared.updater.load_state_dict(state["updater"])
        for key, value in stateful.items():
            if key not in saved["stateful"]:
                raise UserError(f"ctx.load_checkpoint: key {key!r}", f"is not in checkpoint {path}",
                                f"it holds {', '.join(sorted([*saved['stateful'], *saved['values']]))}")
            value.load_state_dict(saved["stateful"][key])
    except (RuntimeError, KeyError, ValueError) as exc:  # shapes or optimiser groups that do not fit
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ("load it into the model and optimiser it was saved from, or use another out=" if expected is None
                else "resume with the settings the run was started with, or use another --out")
        raise UserError(what, f"the checkpoint does not fit this run ({first_line})", hint) from None
    if state["world_size"] == runtime.world_size:  # the same ranks draw the same random numbers on
        checkpoint_files.restore_rng(state["rng"][runtime.rank], runtime.device)
    return {**saved["values"], "step": state["position"]["global_step"], "path": str(path)}


def _from_trainer(state: dict[str, Any]) -> dict[str, Any]:
    """The objects of a checkpoint written by ``nodescale train`` before it ran on this engine."""
    position = state["position"]
    loader = {"epoch": position["epoch"], "batch_in_epoch": position["batch_in_epoch"],
              "global_batch": state["batch_size"] * state["world_size"]}
    return {"model_key": "model", "optimizer_key": "optimizer", "values": {},
            "stateful": {"scheduler": state["scheduler"], "loader": loader}}


def _check_layout(state: dict[str, Any], strategy: Strategy, what: str) -> None:
    layout = state.get("layout")
    if layout != strategy.sharded_layout:
        writer = "DeepSpeed" if layout == "deepspeed" else "torch.distributed.checkpoint"
        raise UserError(
            f"{what} with strategy {strategy.name!r}",
            f"the checkpoint is in {writer}'s sharded format ({layout}), which this strategy does not read",
            f"resume with {'--strategy ' if what.startswith('--resume') else 'strategy='}"
            f"{state['config']['strategy']['name']}, or export the weights with `nodescale checkpoint export "
            f"{state['config'].get('out') or 'RUN_DIR'}` and start a new run",
        )


def _check_named(model_key: str | None, optimizer_key: str | None, prepared: Prepared | None, call: str) -> None:
    """A checkpoint holds the prepared model and optimiser together: the strategy saves them as one."""
    if prepared is None:
        return
    if prepared.optimizer is None:
        raise UserError(f"{call}({{...}})", "needs the model and its optimiser prepared together",
                        "model, optimizer = ctx.prepare(model, optimizer)")
    if model_key is None or optimizer_key is None:
        missing = "model" if model_key is None else "optimizer"
        raise UserError(f"{call}({{...}})", f"the dict does not name the {missing} that ctx.prepare returned",
                        '{"model": model, "optimizer": optimizer, ...} with the objects ctx.prepare returned')


def model_name(model: nn.Module) -> str:
    """The class name the user wrote (FSDP2 subclasses it as ``FSDP<Name>``)."""
    from nodescale.models.introspect import unwrap

    return next(c.__name__ for c in type(unwrap(model)).__mro__ if not c.__name__.startswith("FSDP"))
