"""The run directory is owned: nodescale's own or empty, and one run in it at a time.

A run directory is one nodescale made: the marker ``.nodescale-run`` is its first file. Runs
made before the marker existed are recognised by their files (``metrics.jsonl``,
``summary.json``, ``checkpoints/``, or a ``ranks.log`` nodescale's launcher began); an empty
directory is taken and marked. Anything else is refused with its path: nodescale would replace
its ``config.yaml`` and append to its files. A run holds the directory's lock
(:mod:`~nodescale.engine.run_lock`) from its claim to its end.

Both faces claim here: ``nodescale train`` (its launcher for its workers, else rank 0) and
``nodescale.init(out=...)`` (rank 0); the other ranks learn the verdict and raise the same error.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from nodescale.atomic_files import write_text_atomic
from nodescale.engine.file_errors import blocking_file, file_error, reported
from nodescale.engine.run_lock import HELD_VARIABLE, LOCK_NAME, RunLock, acquire, another, peek
from nodescale.errors import UserError

if TYPE_CHECKING:  # the launcher claims without importing torch: its workers start sooner
    from nodescale.distributed.process_group import Runtime

MARKER = ".nodescale-run"
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")
RUN_DIR_MODE = 0o750  # a job directory's (launch.job_files): you and your group may read it, nobody else
# The first line nodescale's local launcher writes into ranks.log (launch.schedulers.local_rank_output).
_LAUNCHER_LOG = ("ranks.log", b"nodescale: ")


def named(flag: str, run_dir: Path) -> str:
    """How an error names the run directory: ``--out 'x'``, or ``nodescale.init(out='x')``."""
    return f"{flag} {str(run_dir)!r}" if flag.startswith("--") else f"nodescale.init({flag}{str(run_dir)!r})"


def run_files_in(run_dir: Path) -> list[str]:
    """What of a run ``run_dir`` already holds (metrics, summary, checkpoints): empty for a fresh directory."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def is_nodescale_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` is nodescale's: marked, or an older run recognised by its files."""
    if (run_dir / MARKER).exists() or run_files_in(run_dir):
        return True
    name, start = _LAUNCHER_LOG
    try:
        with open(run_dir / name, "rb") as log:
            return log.read(len(start)) == start
    except OSError:
        return False


def foreign_entries(run_dir: Path) -> list[str]:
    """The names in ``run_dir`` that make it someone else's directory: none for nodescale's or an empty one."""
    if is_nodescale_run(run_dir):
        return []
    return sorted(name for name in os.listdir(run_dir) if not name.startswith(LOCK_NAME))


def check_run_dir(run_dir: Path, resume: bool, flag: str = "--out") -> None:
    """Refuse, without writing anything, a run directory this run may not use.

    Refused: a path that cannot be a directory (a file in the way, a name too long), a directory
    of someone else's files, one another live run holds, and one holding a run without
    ``resume``: appending a fresh run's metrics to an old one's, or overwriting its checkpoints,
    would lose or corrupt results.
    """
    what, other = named(flag, run_dir), another(flag)
    try:
        is_dir = run_dir.is_dir()
    except OSError as error:  # a name too long, a loop of links
        raise file_error(what, run_dir, error, other, doing="used") from None
    if not is_dir:
        if run_dir.exists():
            raise UserError(what, "exists and is not a directory", other)
        blocking = blocking_file(run_dir)
        if blocking is not None:
            raise UserError(what, f"cannot be made: {str(blocking)!r} is a file, not a directory", other)
        return
    with reported(what, run_dir, other):
        foreign = foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(what, f"holds files that are not a nodescale run's ({shown})",
                        f"nodescale writes only into a new or empty directory, or a run of its own: {other}")
    peek(run_dir, what, flag)
    used = [] if resume else run_files_in(run_dir)
    if used:
        raise UserError(what, f"already holds a run ({', '.join(used)})",
                        f"pass --resume to continue it, or {other}")


def make_run_dir(run_dir: Path, flag: str = "--out") -> None:
    """Create ``run_dir`` (and the directories above it) as nodescale's: its marker first."""
    with reported(named(flag, run_dir), run_dir, another(flag)):
        run_dir.mkdir(parents=True, exist_ok=True, mode=RUN_DIR_MODE)
        if not (run_dir / MARKER).exists():
            marker = {"made_by": "nodescale", "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
            write_text_atomic(run_dir / MARKER, json.dumps(marker) + "\n")


def claim(run_dir: Path, resume: bool, flag: str = "--out") -> RunLock:
    """Check ``run_dir`` (:func:`check_run_dir`), make it nodescale's, and take its lock for this run."""
    check_run_dir(run_dir, resume, flag)
    make_run_dir(run_dir, flag)
    lock = acquire(run_dir, named(flag, run_dir), flag)
    try:  # under the lock: a run that ended between the check and the lock left its files
        check_run_dir(run_dir, resume, flag)
    except BaseException:
        lock.release()
        raise
    return lock


def claim_together(run_dir: Path, runtime: Runtime, resume: bool, flag: str) -> RunLock | None:
    """Rank 0 claims ``run_dir``; every rank returns, or raises rank 0's UserError, together."""
    verdict: list[tuple[str, str, str | None] | None] = [None]
    lock = None
    if runtime.is_main:
        try:
            lock = claim(run_dir, resume, flag)
        except UserError as exc:
            verdict = [(exc.what, exc.rule, exc.hint)]
    if runtime.has_process_group:
        import torch.distributed as dist

        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise UserError(*verdict[0])
    return lock


@contextmanager
def held_for_workers(run_dir: Path, resume: bool, flag: str = "--out") -> Iterator[RunLock]:
    """A launcher's claim on ``run_dir`` for the workers it starts inside: they find its lock theirs."""
    lock = claim(run_dir, resume, flag)
    before = os.environ.get(HELD_VARIABLE)
    os.environ[HELD_VARIABLE] = f"{os.getpid()} {os.path.abspath(run_dir)}"
    try:
        yield lock
    finally:
        if before is None:
            os.environ.pop(HELD_VARIABLE, None)
        else:
            os.environ[HELD_VARIABLE] = before
        lock.release()
