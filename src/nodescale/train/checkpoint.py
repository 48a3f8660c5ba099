"""Checkpoints of the whole training state, written by global rank 0 only.

A checkpoint holds the model, optimiser, scheduler and gradient-scaler states,
where training stands (epoch, step within it, samples seen) and every rank's
random-number state, so that a resumed run ends with the same weights as an
uninterrupted one. Files are written atomically and the newest ``keep_last``
are kept; resuming skips a file that does not load and takes the one before.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch

from nodescale.atomic_files import write_atomic
from nodescale.errors import UserError

FORMAT = "nodescale-checkpoint/1"
_NAME = re.compile(r"^step-(\d{8,})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint file in the run, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def save(run_dir: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` and delete all but the newest ``keep_last``."""
    path = checkpoint_path(run_dir, step)
    write_atomic(path, lambda handle: torch.save({"format": FORMAT, **state}, handle))
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


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

    A file that fails to load (truncated, corrupt) is reported and skipped in
    favour of the one before it; if none loads, that is an error.
    """
    candidates = list_checkpoints(run_dir)
    for _, path in reversed(candidates):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
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
