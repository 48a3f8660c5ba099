"""A collective that failed because of another rank, told as such instead of as a backend traceback.

gloo reports a peer that stopped answering as ``Timed out waiting 5000ms for recv
operation`` or ``Application timeout caused pair closure``, and a peer that died as
``Connection reset by peer``; to a user both read as a nodescale bug. The rank
that sees them is healthy: the fault is elsewhere, and its own output (or the
heartbeat watchdog's report) says which rank. NCCL's timeouts are raised by its
own watchdog thread, which ends the process before Python sees an exception.

When that rank stopped on a user error and handed it over to whoever started the ranks
(nodescale's launcher, or a job script's restart loop: ``NODESCALE_ERROR_DIR``), this rank
says nothing at all: the user reads that error once, with its rank and hint, and no line
about its consequence.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

from nodescale.launch.schedulers.local_launcher import ranks_with_user_errors
from nodescale.stop_signals import EXIT_HANG

_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_SOURCE = re.compile(r"^\[[^\]]*\]\s*")  # gloo's [gloo/transport/tcp/pair.cc:553]
_PEER_GONE = re.compile(r"connection reset|connection closed|broken pipe|connection refused|peer.*(closed|died)",
                        re.IGNORECASE)


@dataclass(frozen=True)
class CollectiveFault:
    """Said in place of the backend's error: ``message`` is what the user reads, ``exit_code`` the process's."""

    message: str
    exit_code: int


class LeftAfterCollectiveFault(SystemExit):
    """``run_training`` said a :class:`CollectiveFault` and left the group: end the process with ``code``.

    A library caller may catch it like any SystemExit; a process entry point calls
    :func:`end_process_now` instead of returning.
    """


def end_process_now(code: int) -> NoReturn:
    """Exit with ``code`` without the interpreter's teardown, after flushing the output.

    After a peer vanished mid-collective, destroying gloo's pairs and a c10d store that still
    has the lost peer's connection can hit ``std::terminate`` at interpreter exit, turning exit
    code 4 into SIGABRT. Nothing is left to save by then: the run's files were closed when the
    fault was reported.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def classify(exc: BaseException) -> str | None:
    """``"timeout"``, ``"peer-gone"`` or None (not a collective failure caused by another rank)."""
    if not isinstance(exc, RuntimeError):  # torch's DistBackendError and DistNetworkError are RuntimeErrors
        return None
    text = str(exc)
    if _TIMEOUT.search(text):
        return "timeout"
    if _PEER_GONE.search(text):
        return "peer-gone"
    return None


def explain(exc: BaseException, rank: int, step: int, timeout_s: float) -> CollectiveFault | None:
    """The fault to raise instead of ``exc``, or None to let ``exc`` go on unchanged; an empty ``message`` when
    another rank's user error explains it (exit code 1, as for any rank whose peer failed)."""
    kind = classify(exc)
    if kind is None:
        return None
    if any(other != rank for other in ranks_with_user_errors()):
        return CollectiveFault("", 1)
    # The backend's first sentence: gloo adds its source line and advice to every message.
    first = _SOURCE.sub("", str(exc).strip()).splitlines()[0].split(". ")[0][:200] if str(exc).strip() else \
        type(exc).__name__
    who = f"rank {rank} on host {socket.gethostname()}"
    if kind == "timeout":
        return CollectiveFault(
            f"nodescale: hang: {who} at step {step} waited longer than the collective timeout ({timeout_s:g} s) for "
            f"another rank ({first}); that rank stopped, died or fell behind. --heartbeat-timeout names it (on by "
            "default); --collective-timeout raises the limit for legitimately slow steps", EXIT_HANG)
    return CollectiveFault(
        f"nodescale: {who} stopped at step {step}: it lost its connection to another rank during a collective "
        f"({first}); that rank failed: its own output, or the launcher's last lines, say why", 1)
