"""Checkpoints written in the background (``--checkpoint-async``): training goes on while the files are written.

The training thread only copies the state to host memory (the stall that is left); a thread
of each rank then writes it: a sharded state through DCP's ``async_save``, a full one with
``torch.save`` on rank 0, with the same files, syncs and manifest as a save that waits
(``checkpoint_files``). The manifest comes last, once every rank's files are synced, so a
job killed mid-save leaves a ``.partial`` or a temporary file that resume never takes.
One save is in flight at a time: the next save, the run's end and a requeue exit wait for
it, and a failure (a full disk) is raised at the next step or at that wait, on every rank.
The background collectives use a gloo group of their own, never the training's.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from nodescale.distributed.process_group import Runtime, barrier
from nodescale.engine import checkpoint_files, disk_space
from nodescale.engine.manifest import all_gather
from nodescale.errors import UserError


class BackgroundSaves:
    """This rank's checkpoint save in flight (one at most), and the gloo group its collectives use."""

    def __init__(self, record: Callable[[dict[str, Any]], None]) -> None:
        self._record = record  # the run's metrics log, written on the training thread only
        # --checkpoint-stage: after the write, its copy into the run directory (step, staged path -> final path)
        self.after: Callable[[int, Path], Path] | None = None
        self._thread: threading.Thread | None = None
        self._step = 0
        self._outcome: Path | BaseException | None = None
        self._group: Any = None

    def group(self) -> Any:
        """A gloo group of every rank, made at the first background save (a collective); None without a group."""
        import torch.distributed as dist

        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def start(self, step: int, write: Callable[[], Path]) -> None:
        """Run ``write`` (this rank's part of checkpoint ``step``; returns its path) in the background."""
        def run() -> None:
            try:
                written = write()
                self._outcome = self.after(step, written) if self.after else written
            except BaseException as error:  # raised on the training thread by wait()
                self._outcome = error

        self._step = step
        # A daemon: a rank that fails meanwhile exits without waiting for a write its peers abandoned.
        self._thread = threading.Thread(target=run, name=f"nodescale-checkpoint-{step}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> None:
        """At a step boundary: when the save in flight has finished, report it, or raise its error."""
        if self._thread is not None and not self.in_flight:
            self.wait()

    def wait(self) -> None:
        """Until the save in flight (if any) is whole on disk; raises the error that stopped it."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, outcome = None, self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        self.published(self._step, outcome)

    def published(self, step: int, path: Path) -> None:
        """Checkpoint ``step`` is whole at ``path``: one record in the metrics log."""
        self._record({"kind": "checkpoint", "step": step, "path": str(path)})


def host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to host memory and the rest deep-copied: what a background
    write reads while training changes the originals."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = type(value)((key, host_copy(item)) for key, item in value.items())
        if hasattr(value, "_metadata"):  # a module's state dict: its version numbers, as torch.save keeps them
            copied._metadata = copy.deepcopy(value._metadata)
        return copied
    if type(value) in (list, tuple):
        return type(value)(host_copy(item) for item in value)
    return copy.deepcopy(value)


def start_full(saves: BackgroundSaves, run_dir: Path, step: int, runtime: Runtime, state: dict[str, Any],
               keep_last: int) -> Path:
    """Every rank: checkpoint file ``step`` of ``state`` (whole on rank 0), written by rank 0 in the background."""
    group, staged = saves.group(), host_copy(state) if runtime.is_main else None

    def write() -> Path:
        error = None
        if runtime.is_main:
            error = _caught(lambda: checkpoint_files.save(run_dir, step, staged, keep_last))
        agree(_as_reported(error, run_dir, step, runtime.is_main), group, step)
        return checkpoint_files.checkpoint_path(run_dir, step)

    saves.start(step, write)
    return checkpoint_files.checkpoint_path(run_dir, step)


def start_sharded(saves: BackgroundSaves, run_dir: Path, step: int, runtime: Runtime,
                  save_shards: Callable[[Path, Any], Future], trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Every rank: sharded checkpoint ``step``, its shards staged now (``save_shards(directory, group)``,
    the strategy's async save) and written, listed and renamed into place in the background."""
    group = saves.group()
    if runtime.is_main:
        checkpoint_files.begin_sharded(run_dir, step)
    barrier(runtime)
    shards = save_shards(checkpoint_files.partial_dir(run_dir, step), group)
    staged = host_copy(trainer_state)

    def write() -> Path:
        # Every rank's shards written and synced (DCP syncs each file) before the manifest lists them.
        agree(_as_reported(_caught(shards.result), run_dir, step, runtime.is_main), group, step)
        try:
            return checkpoint_files.finish_sharded(run_dir, step, runtime.is_main, lambda: agree(None, group, step),
                                                   lambda: staged, keep_last, group)
        except BaseException as error:
            raise _as_reported(error, run_dir, step, runtime.is_main) from error

    saves.start(step, write)
    return checkpoint_files.sharded_checkpoint_path(run_dir, step)


def _caught(work: Callable[[], Any]) -> BaseException | None:
    try:
        work()
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        return error
    return None


def _as_reported(error: BaseException | None, run_dir: Path, step: int, is_main: bool) -> BaseException | None:
    """A full disk as the error a save that waits gives; anything else as it is."""
    return None if error is None else disk_space.as_full_error(error, run_dir, step, is_main)


def agree(error: BaseException | None, group: Any, step: int) -> None:
    """Every rank of ``group``: raise this rank's error, else the first other rank's, so that all stop together."""
    others = all_gather(_portable(error), group) if group is not None else []
    if error is not None:
        raise error
    for rank, other in enumerate(others):
        if isinstance(other, UserError):
            raise other
        if other is not None:
            raise RuntimeError(f"checkpoint step {step}: the background save failed on rank {rank}: {other}")


def _portable(error: BaseException | None) -> UserError | str | None:
    """What another rank can unpickle of ``error``: a UserError whole, anything else as text."""
    if error is None or isinstance(error, UserError):
        return error
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
