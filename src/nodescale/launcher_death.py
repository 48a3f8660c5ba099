"""A worker whose launcher died ends itself at once, whatever its main thread is doing.

nodescale's local launcher asks Linux for SIGTERM to each worker when it dies
(``PR_SET_PDEATHSIG``), and tells each worker, in :data:`PARENT_VARIABLE`, the pid of the
process it dies with (the launcher, or the fork server that dies with it). SIGTERM's default
action ends a worker; but a worker whose stop handler catches SIGTERM
(:class:`~nodescale.engine.preemption.StopRequest`) would only note it as a stop request, looked
at between steps, and a rank blocked in a collective or in the user's code never gets there.
So such a worker also watches its parent, from a thread that runs whatever the main thread does:
once the parent is gone, nobody reads its output, collects its exit code or requeues the run, and
it ends without checkpointing (the previous checkpoint stays whole). The death signal arrives as
the parent goes, and the thread looks every :data:`POLL_SECONDS`, so the rank is gone within a
second of its launcher, the same under any stop-agreement schedule.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import suppress
from typing import NoReturn

# Set by the local launcher for its workers (and by its fork server for the ranks it forks).
PARENT_VARIABLE = "NODESCALE_PARENT_PID"
POLL_SECONDS = 0.5
# Nobody is left to read it; 1 like any failed worker, should a reaper look.
EXIT_LAUNCHER_GONE = 1

_watched: int | None = None  # the parent pid being watched, once the thread runs


def child_variables() -> dict[str, str]:
    """What a launcher adds to the environment of the children it dies with (``die_with_parent``)."""
    return {PARENT_VARIABLE: str(os.getpid())}


def watch_launcher() -> bool:
    """Start the watching thread (once per process); whether this process is a launcher's worker.

    Call it before catching SIGTERM: until then a launcher's death ends the process by the
    signal's default action. A process whose parent is not the one named (a worker's own
    child, which inherits the variable) is not watched.
    """
    global _watched
    if _watched is not None:
        return True
    named = os.environ.get(PARENT_VARIABLE, "")
    if not named.isdigit() or int(named) != os.getppid():
        return False
    _watched = int(named)
    threading.Thread(target=_watch, name="nodescale-launcher-watch", daemon=True).start()
    return True


def launcher_gone() -> bool:
    """Whether the watched parent has ended (this process was handed to init or a subreaper)."""
    return _watched is not None and os.getppid() != _watched


def end_with_launcher() -> NoReturn:
    """Say why on stderr (where it still goes somewhere) and end the process now, from any thread."""
    line = (f"nodescale: rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): its launcher (pid {_watched}) "
            "is gone; ending this process\n")
    with suppress(OSError):  # a pipe to the dead launcher: the line has nowhere to go
        os.write(2, line.encode())
    os._exit(EXIT_LAUNCHER_GONE)


def _watch() -> None:
    while not launcher_gone():
        time.sleep(POLL_SECONDS)
    end_with_launcher()
