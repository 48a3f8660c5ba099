"""Checkpoints of the whole training state, in one of two layouts.

A checkpoint holds the model, optimiser, scheduler and gradient-scaler states,
where training stands (epoch, step within it, samples seen) and every rank's
random-number state, so that a resumed run ends with the same weights as an
uninterrupted one.

* full: ``checkpoints/step-NNNNNNNN.pt``, one file that global rank 0 writes
  after gathering the whole state (DDP's default; the most portable).
* sharded: ``checkpoints/step-NNNNNNNN/``, a directory every rank writes its
  shards into (the strategy's ``save_sharded``: torch.distributed.checkpoint, or
  DeepSpeed's own files), with ``trainer.pt`` (everything but model and
  optimiser) beside them. It must be on a file system every node sees.

Both are atomic: a file is renamed into place, a directory is written as
``step-NNNNNNNN.partial`` and renamed when every rank has finished. The newest
``keep_last`` are kept; resuming skips one that does not load and takes the one
before.
"""

from __future__ import annotations

import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nodescale.atomic_files import write_atomic
from nodescale.errors import UserError

FORMAT = "nodescale-checkpoint/1"
TRAINER_FILE = "trainer.pt"  # inside a sharded checkpoint directory
_NAME = re.compile(r"^step-(\d{8,})(\.pt)?$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}.pt"


def sharded_checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}"


def is_sharded(path: Path) -> bool:
    return path.is_dir()


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint (file or sharded directory) in the run, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        # A directory counts only with its trainer state: the rename makes both appear together.
        if match and (path.is_file() if match.group(2) else (path / TRAINER_FILE).is_file()):
            found.append((int(match.group(1)), path))
    return sorted(found)


def save(run_dir: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write ``state`` as the checkpoint file of ``step`` and delete all but the newest ``keep_last``."""
    path = checkpoint_path(run_dir, step)
    write_atomic(path, lambda handle: torch.save({"format": FORMAT, **state}, handle))
    _prune(run_dir, keep_last)
    return path


def partial_dir(run_dir: Path, step: int) -> Path:
    """Where every rank writes the shards of ``step`` before the directory is renamed into place."""
    return sharded_checkpoint_path(run_dir, step).with_name(f"step-{step:08d}.partial")


def begin_sharded(run_dir: Path, step: int) -> Path:
    """Rank 0, before the writers start: an empty partial directory for ``step``."""
    partial = partial_dir(run_dir, step)
    shutil.rmtree(partial, ignore_errors=True)  # left by a run that died while saving
    partial.mkdir(parents=True)
    return partial


def finish_sharded(run_dir: Path, step: int, trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Rank 0, after every rank wrote its shards: add the trainer state and rename into place."""
    partial = partial_dir(run_dir, step)
    write_atomic(partial / TRAINER_FILE, lambda handle: torch.save({"format": FORMAT, **trainer_state}, handle))
    final = sharded_checkpoint_path(run_dir, step)
    if final.exists():  # the same step saved again (a resumed run): replace it
        stale = final.with_name(final.name + ".stale")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        partial.rename(final)
    _prune(run_dir, keep_last)
    return final


def write_sharded(run_dir: Path, step: int, is_main: bool, barrier: Callable[[], None],
                  write_shards: Callable[[Path], None], trainer_state: Callable[[], dict[str, Any]],
                  keep_last: int) -> Path:
    """Every rank: write a sharded checkpoint of ``step``; returns its final path.

    ``write_shards(directory)`` is the strategy's collective save; ``trainer_state()``
    is called on rank 0 only, after the shards are complete.
    """
    if is_main:
        begin_sharded(run_dir, step)
    barrier()
    write_shards(partial_dir(run_dir, step))
    barrier()  # every shard is on disk before the directory becomes visible
    final = sharded_checkpoint_path(run_dir, step)
    if is_main:
        finish_sharded(run_dir, step, trainer_state(), keep_last)
    barrier()  # nobody reads or prunes checkpoints while rank 0 renames
    return final


def _prune(run_dir: Path, keep_last: int) -> None:
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


# What must be the same for the saved weights and optimiser state to fit the resumed run.
_STATE_KEYS = (("model", "name"), ("model", "stem"), ("model", "patch_size"), ("data", "name"),
               ("data", "image_size"), ("data", "channels"), ("data", "num_classes"), ("optim", "name"))


def check_compatible(state: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Raise ``UserError`` if ``state`` was saved by a run whose model or optimiser differ.

    ``current`` is the resumed run's configuration as a plain dict.
    """
    saved = state.get("config", {})
    differences = []
    for section, key in _STATE_KEYS:
        before, now = saved.get(section, {}).get(key), current[section][key]
        if before != now:
            differences.append(f"{section}.{key} was {before!r}, now {now!r}")
    if differences:
        raise UserError(
            f"--resume from {path}",
            "the checkpoint was saved by a run with another model, data or optimiser: " + "; ".join(differences),
            f"resume with the run's own settings (--config {path.parent.parent / 'config.yaml'}), "
            "or start a new run with another --out",
        )


def load_newest(run_dir: Path) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that loads, or ``None`` when the run has none.

    For a sharded checkpoint the state is its trainer state only: the strategy
    reads the model and optimiser from the directory. A file that fails to load
    (truncated, corrupt) is reported and skipped in favour of the one before it;
    if none loads, that is an error.
    """
    candidates = list_checkpoints(run_dir)
    for _, path in reversed(candidates):
        try:
            state = torch.load(path / TRAINER_FILE if is_sharded(path) else path, map_location="cpu",
                               weights_only=True)
        except Exception as exc:  # any unreadable file: fall back to an older one
            warnings.warn(f"checkpoint {path} does not load ({type(exc).__name__}); trying an older one",
                          stacklevel=2)
            continue
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            warnings.warn(f"checkpoint {path} is not a {FORMAT} file; trying an older one", stacklevel=2)
            continue
        return state, path
    if candidates:
        raise UserError(f"checkpoints in {checkpoint_dir(run_dir)}", "none of them loads",
                        "start afresh without --resume, or restore a good copy")
    return None
