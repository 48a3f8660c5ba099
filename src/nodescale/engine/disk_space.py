"""Room for checkpoints: a warning before a save that may not fit, and a plain error when one did not.

A full disk or an exhausted quota (common on a cluster's home and project file systems)
otherwise surfaces as torch's ``unexpected pos`` deep in a traceback, and a restart cannot
fix it. Saves are atomic (a temporary name, then a rename), so the newest whole checkpoint
is intact whatever happened to the next one: the error says which step that is.
"""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from pathlib import Path

from nodescale.engine import checkpoint_files
from nodescale.errors import UserError

OUT_OF_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


def free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``directory``'s file system (None if unknown)."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def size_bytes(path: Path) -> int:
    """A checkpoint's size: its file, or every file of its directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def warn_if_short(run_dir: Path, step: int) -> None:
    """Before saving ``step``: warn when the newest checkpoint would not fit in the space left.

    The new checkpoint is written beside the old ones before they are pruned, so it needs
    its whole size free.
    """
    existing = checkpoint_files.list_checkpoints(run_dir)
    directory = checkpoint_files.checkpoint_dir(run_dir)
    free = free_bytes(directory) if existing else None
    if free is None:
        return
    needed = size_bytes(existing[-1][1])
    if free < needed:
        warnings.warn(f"checkpoint step {step} needs about {_mb(needed)} in {directory}, and {_mb(free)} is free: "
                      f"the save will likely fail (step {existing[-1][0]} stays whole)", stacklevel=2)


def out_of_space(error: BaseException) -> str | None:
    """What ran out anywhere in ``error``'s chain (``no space left on device``, ...), else None.

    torch reports a failed write as a RuntimeError (``unexpected pos``: its zip writer wrote
    less than it meant to), raised while handling the OSError, if there is one; a sharded
    save gathers every rank's error into a CheckpointException (``failures``), without their
    chains. So ``__cause__``, ``__context__`` and ``failures`` are all followed.
    """
    seen: set[int] = set()
    pending: list[object] = [error]
    short_write = False
    while pending:
        current = pending.pop()
        if isinstance(current, tuple) and current:  # DCP's (exception, stack summary)
            current = current[0]
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in OUT_OF_SPACE:
            return OUT_OF_SPACE[current.errno]
        short_write = short_write or (isinstance(current, RuntimeError) and "unexpected pos" in str(current))
        pending += [current.__cause__, current.__context__, *getattr(current, "failures", {}).values()]
    return "a write came up short (a full file system, or one over its quota)" if short_write else None


def full_error(run_dir: Path, step: int, what_ran_out: str) -> UserError:
    """The error for a save of ``step`` that ran out of room, naming the step that is still whole."""
    directory = checkpoint_files.checkpoint_dir(run_dir)
    whole = [(found, path) for found, path in checkpoint_files.list_checkpoints(run_dir) if found != step]
    free = free_bytes(directory)
    needed = f"about {_mb(size_bytes(whole[-1][1]))} needed, " if whole else ""  # the last one's size
    rule = what_ran_out + (f" ({needed}{_mb(free)} free)" if free is not None else "")
    kept = (f"step {whole[-1][0]} is whole: make room, then run again with --resume" if whole
            else "no checkpoint was saved yet")
    return UserError(f"checkpoint step {step} in {directory}", rule,
                     f"{kept}; --keep-last 1 keeps fewer, --out puts the run on a larger file system")


def as_full_error(error: BaseException, run_dir: Path, step: int, is_main: bool) -> BaseException:
    """``error`` as :func:`full_error` when the save of ``step`` ran out of room, else ``error`` itself.

    Rank 0 then removes the shards written so far: never loadable, and the space is needed.
    """
    ran_out = None if isinstance(error, UserError) else out_of_space(error)
    if ran_out is None:
        return error
    if is_main:
        shutil.rmtree(checkpoint_files.partial_dir(run_dir, step), ignore_errors=True)
    reported = full_error(run_dir, step, ran_out)
    reported.__cause__ = error
    return reported


def _mb(count: int) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e9 else f"{count / 1e6:.2f} MB"
