"""The permissions of what nodescale writes for a job: one rule, whatever the scheduler.

A job directory nodescale creates (``--job-dir`` for Slurm, PBS and local launches; the run
directory that ``train --nproc`` keeps ``ranks.log`` in, when the launcher creates it) is 0750:
you and your group may read it, nobody else may even list it. Scripts in it are 0750, logs
0640. A umask can only make these stricter; a directory that exists already keeps its mode.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO

JOB_DIR_MODE = 0o750
SCRIPT_MODE = 0o750
LOG_MODE = 0o640


def make_job_dir(path: Path) -> None:
    """``path`` (and missing parents, by the umask) created ``JOB_DIR_MODE`` where missing."""
    path.mkdir(parents=True, exist_ok=True, mode=JOB_DIR_MODE)


def create_script(path: Path) -> int:
    """A descriptor of the new file ``path``, ``SCRIPT_MODE``; ``FileExistsError`` if it exists."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SCRIPT_MODE)


def open_log(path: Path) -> IO[str]:
    """``path`` opened to append to (created ``LOG_MODE``); an older log's extra permissions are taken away."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, LOG_MODE)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & ~LOG_MODE:
        try:
            os.fchmod(fd, mode & LOG_MODE)
        except OSError:  # another user's file we may write to: leave its mode to them
            pass
    return open(fd, "w", encoding="utf-8")
