"""The launcher's temporary files go when the launcher does, however it ends (``kill -9`` included).

A ``with TemporaryDirectory()`` is removed on a normal end, but not when the process is killed
outright. So the first path handed to :func:`remove_at_exit` starts a small helper process that
holds the read end of a pipe; the launcher keeps the write end, and the kernel closes it when the
launcher ends, whatever ends it. At that end of file the helper removes every path it was told
about (those already removed are skipped) and exits: it outlives the launcher by that much only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

# The helper: paths arrive NUL-terminated until the launcher's end closes the pipe, then go. Signals sent
# to every process of a job step (a scheduler's warning, its stop) must not end it before then.
_HELPER = """
import os, shutil, signal, sys
for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
for path in filter(None, sys.stdin.buffer.read().split(b"\\0")):
    try:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:  # removed already, by the launcher's own end
        pass
"""

# The pid of the process it serves, the pipe's write end and the helper (kept: it is never waited for).
_helper: tuple[int, int, subprocess.Popen[bytes]] | None = None


def remove_at_exit(path: str | Path) -> None:
    """Remove ``path`` (a file or a directory tree) when this process ends, if it is still there."""
    global _helper
    if _helper is None or _helper[0] != os.getpid():  # a forked child starts its own: the parent may end first
        read_end, write_end = os.pipe()
        try:
            # A session of its own: the terminal's Ctrl-C, which ends the launcher, must not end it first.
            helper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _HELPER], stdin=read_end,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        _helper = (os.getpid(), write_end, helper)  # the write end is never closed: the process's end closes it
    with suppress(OSError):  # the helper killed: the launch goes on, and a normal end still removes the path
        os.write(_helper[1], os.fsencode(path) + b"\0")
