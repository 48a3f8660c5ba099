"""Each local rank's output, labelled ``[rankN]: `` on the terminal and kept in a log file.

The cluster jobs label every line with its rank (:mod:`nodescale.launch.rank_labels`); with
``--nproc`` > 1 nodescale's local launcher does the same: each rank's stdout and stderr go
into pipes of their own, and a thread per pipe copies whole lines, labelled, to the launcher's
stdout or stderr and to
``ranks.log`` (in the run directory for ``train``, the job directory for ``launch``), which
``nodescale logs DIR [--rank R] [--failure]`` reads. Rank 0's stdout, the run's own output, goes
to the launcher's stdout as it is, unlabelled (on a terminal :data:`TERMINAL_VARIABLE` tells rank
0 to draw its progress bar into the pipe), and to the log as plain labelled lines.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import IO

from nodescale.launch.job_files import make_job_dir
from nodescale.launch.job_files import open_log as open_job_log

LOG_NAME = "ranks.log"
# Set for the ranks when the launcher's stdout is a terminal: its width, for rank 0's progress bar.
TERMINAL_VARIABLE = "NODESCALE_TERMINAL_COLUMNS"
_CONTROL = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")  # cursor moves and erasures of a progress bar
_JOIN_SECONDS = 5.0  # a rank's child that outlives it may hold its pipe open: do not wait for it forever


class RankOutput:
    """The pipes of one worker group's ranks and the threads that copy their lines."""

    def __init__(self, log: IO[str], nproc: int) -> None:
        self._log = log
        self._lock = threading.Lock()
        # Two pipes per rank: its stdout reaches the launcher's stdout and its stderr the launcher's stderr.
        pipes = [os.pipe() for _ in range(2 * nproc)]
        self.write_fds = [write for _, write in pipes]  # rank r's stdout: [2r], its stderr: [2r + 1]
        self._threads = [threading.Thread(target=self._copy, args=(index // 2, index % 2, read), daemon=True,
                                          name=f"nodescale-rank{index // 2}-output")
                         for index, (read, _) in enumerate(pipes)]
        for thread in self._threads:
            thread.start()

    def fds(self, rank: int) -> tuple[int, int]:
        """The write ends that become rank ``rank``'s stdout and stderr."""
        return self.write_fds[2 * rank], self.write_fds[2 * rank + 1]

    def started(self) -> None:
        """The ranks hold their ends now: close ours, so that a rank's end is its pipe's end."""
        for fd in self.write_fds:
            os.close(fd)
        self.write_fds = []

    def close(self) -> None:
        """Wait (a little) for the last lines, then stop copying."""
        self.started()
        for thread in self._threads:
            thread.join(_JOIN_SECONDS)

    def _copy(self, rank: int, stream: int, fd: int) -> None:
        terminal = sys.stderr if stream else sys.stdout
        raw = rank == 0 and not stream  # rank 0's stdout as it is (its progress bar): the run's own output
        with open(fd, "rb", buffering=0) as pipe:
            pending = shown = b""
            while chunk := pipe.read(65536):
                if raw:
                    shown = self._show(terminal, shown + chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                pending = pending.rsplit(b"\r", 1)[-1]  # a bar's frames: only the last one may end in a line
                self._write(rank, lines, None if raw else terminal)
            if shown:
                self._emit([terminal], shown.decode(errors="replace"))
            if pending:
                self._write(rank, [pending], None if raw else terminal)

    def _show(self, terminal: IO[str], text: bytes) -> bytes:
        """Rank 0's output up to its last whole line (all of it when it ends in a bar's frame); the rest.

        Unbuffered, ``print`` writes a line and its newline apart: another rank's line between them would split it.
        """
        tail = text[text.rfind(b"\n") + 1:]
        cut = len(text) if b"\r" in tail or b"\x1b" in tail else len(text) - len(tail)
        if cut:
            self._emit([terminal], text[:cut].decode(errors="replace"))
        return text[cut:]

    def _write(self, rank: int, lines: list[bytes], terminal: IO[str] | None) -> None:
        plain = (_CONTROL.sub(b"", line).rsplit(b"\r", 1)[-1] for line in lines)  # the text a terminal shows
        # torch labels an uncaught exception's lines with the rank itself (its excepthook): one label is enough.
        own = f"[rank{rank}]:".encode()
        labelled = (line if line.startswith(own) else b"%s %s" % (own, line) for line in plain)
        text = "".join(f"{line.decode(errors='replace')}\n" for line in labelled)
        self._emit([self._log] if terminal is None else [terminal, self._log], text)

    def _emit(self, streams: list[IO[str]], text: str) -> None:
        with self._lock:
            # A full disk or a closed terminal must not stop the copying: a rank blocks once its pipe is full.
            for stream in streams:
                if stream.closed:
                    continue
                try:
                    stream.write(text)
                    stream.flush()
                except (OSError, ValueError):
                    with suppress(OSError, ValueError):
                        stream.close()


def open_log(directory: Path, nproc: int) -> IO[str]:
    """``DIRECTORY/ranks.log``, appended to, this launch headed: a resumed run keeps the crash that caused it."""
    make_job_dir(directory)
    log = open_job_log(directory / LOG_NAME)
    # The failure summary reads from the last head or restart line on (first_failure.last_attempt).
    note(log, f"nodescale: launch at {time.strftime('%Y-%m-%d %H:%M:%S')} by pid {os.getpid()} "
              f"on {socket.gethostname()}")
    # The failure summary names a failed rank's host from this line (first_failure.placed_hosts).
    note(log, f"nodescale: the local launcher places {nproc} task(s) on each host, in this order: "
              f"{socket.gethostname()}")
    return log


def note(log: IO[str] | None, line: str) -> None:
    """A launcher's line in the log as well (a restart marks where the last attempt's lines start)."""
    if log is not None and not log.closed:
        with suppress(OSError, ValueError):
            log.write(line + "\n")
            log.flush()
