"""N local worker processes with torchrun's environment, watched until they all end or one fails.

This is the part of ``torchrun --standalone`` a single-node job needs, without importing
torch: the launcher starts the workers at once instead of after its own 1.5-10 s
``import torch`` (longer on a parallel filesystem), and the workers start no sooner under
torchrun. What it keeps from torch's agent:

- every variable torchrun gives a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` ...), so any script, Lightning,
  Accelerate and DeepSpeed see a torchrun job; rank 0 hosts the c10d store on loopback;
- each worker in a session of its own, so a terminal's Ctrl-C reaches the launcher only;
- when one worker fails, the others get SIGTERM, 30 s to finish (a checkpoint), then SIGKILL;
- SIGTERM, SIGINT and SIGHUP to the launcher are passed on to the workers the same way, and
  SIGUSR1/SIGUSR2 (the schedulers' warnings before a time limit) are passed on as they are.

Beyond it: on Linux each worker dies with the launcher (``PR_SET_PDEATHSIG``), so a launcher
killed outright (OOM killer, ``kill -9``) leaves no rank hanging in a collective: they get SIGTERM
then, and nodescale's ranks, whose stop handler catches it, see their launcher gone and end
(:mod:`nodescale.launcher_death`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

from nodescale.distributed.env import LOOPBACK
from nodescale.distributed.ports import free_port, listening_socket
from nodescale.errors import program_not_found
from nodescale.launch.schedulers import local_store_server
from nodescale.launcher_death import child_variables

if TYPE_CHECKING:
    from nodescale.launch.schedulers.local_fork_server import ForkedWorker
    from nodescale.launch.schedulers.local_rank_output import RankOutput

    Worker = subprocess.Popen[bytes] | ForkedWorker

# How long a worker told to stop may take (to write its checkpoint) before it is killed: torch's agent's figure.
STOP_GRACE_SECONDS = 30.0
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


@dataclass(frozen=True)
class GroupResult:
    """How a worker group ended."""

    codes: dict[int, int]  # each rank's exit code; negative: ended by that signal
    stopped_by: signal.Signals | None = None  # a stop signal to the launcher ended the group
    stopped: frozenset[int] = frozenset()  # ranks the launcher's signal ended (after a failure or a stop signal)

    @property
    def failures(self) -> dict[int, int]:
        """The ranks that did not exit 0, with their codes."""
        return {rank: code for rank, code in self.codes.items() if code != 0}


def worker_environment(
    base: Mapping[str, str], rank: int, nproc: int, port: int, run_id: str, extra: Mapping[str, str],
    store_process: bool = False,
) -> dict[str, str]:
    """The environment torchrun's agent gives local rank ``rank`` of a one-node job of ``nproc``.

    ``store_process``: a store server runs beside the workers (every rank is its client, as
    under torchrun's agent); otherwise rank 0 serves the store, as under torchrun's static
    rendezvous.
    """
    env = dict(base)
    env.update(extra)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": str(store_process),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    })
    return env


def one_worker_variables(base: Mapping[str, str]) -> dict[str, str]:
    """What ``torchrun --standalone --nproc-per-node 1`` gives its one worker, where ``base`` says otherwise.

    For a command that runs in place of a launcher (``exec``): its rank 0 serves the store, as there
    is no agent store beside it.
    """
    env = worker_environment(base, 0, 1, free_port(LOOPBACK), uuid.uuid4().hex, {})
    return {name: value for name, value in env.items() if base.get(name) != value}


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_worker_group(command: Sequence[str], nproc: int, extra_env: Mapping[str, str] | None = None,
                     grace_seconds: float = STOP_GRACE_SECONDS, store_process: bool = False,
                     preload: Sequence[str] = (), output: RankOutput | None = None) -> GroupResult:
    """Run ``command`` as ranks 0..nproc-1 on this host; return when all have exited.

    Ends early when a worker fails (the others are stopped) or the launcher is told to stop.
    ``store_process``: serve the c10d store from a process of its own on 127.0.0.1, for
    commands whose rank 0 would serve it on every interface (any script's ``env://``); by
    default rank 0 serves it (nodescale's own workers bind it to 127.0.0.1 themselves).
    ``preload``: modules to import once and fork the ranks from, where ``command`` is a
    ``python -m MODULE`` (see :mod:`~nodescale.launch.schedulers.local_fork_server`).
    ``output``: each rank's stdout and stderr go to its pipe there, to be labelled.
    """
    from nodescale.launch.schedulers.local_fork_server import ForkServer, as_python_module

    run_id = uuid.uuid4().hex
    workers: dict[int, Worker] = {}
    server: subprocess.Popen[bytes] | None = None
    forks: ForkServer | None = None
    if store_process:
        server, port = _start_store_server(nproc)
    else:
        port = free_port(LOOPBACK)
    base = {**os.environ, **(extra_env or {})}
    envs = [worker_environment(base, rank, nproc, port, run_id, child_variables(), store_process)
            for rank in range(nproc)]
    module = as_python_module(command) if preload else None

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop(signum)

    def forward(signum: int, frame: FrameType | None) -> None:
        _signal_all(workers, signum)

    def all_forked() -> None:  # ranks become workers once they have a pid to signal
        if forks is not None:
            forks.wait_until_started()
            workers.update(forks.workers)

    previous = _install({**{s: stop for s in STOPPING_SIGNALS}, **{s: forward for s in FORWARDED_SIGNALS}})
    try:
        if module is not None:
            rank_envs = [{name: value for name, value in env.items() if base.get(name) != value} for env in envs]
            forks = ForkServer(module, rank_envs, base, preload, output.write_fds if output else ())
            all_forked()
        for rank, env in enumerate(envs if module is None else []):
            out, err = output.fds(rank) if output else (None, None)
            try:
                workers[rank] = subprocess.Popen(list(command), env=env, start_new_session=True,
                                                 preexec_fn=die_with_parent, stdout=out, stderr=err)
            except FileNotFoundError:
                raise program_not_found(command[0]) from None  # the workers started so far are stopped below
        if output:
            output.started()
        codes = _wait_for_all_or_a_failure(workers)
        return _end_group(workers, signal.SIGTERM, grace_seconds) if any(codes.values()) else GroupResult(codes)
    except _Stop as request:
        # A second stop signal while the workers finish must not interrupt the wait for them.
        _install({s: signal.SIG_IGN for s in STOPPING_SIGNALS})
        all_forked()  # a stop during the fork server's imports reaches the ranks once they exist
        return _end_group(workers, signal.Signals(request.signum), grace_seconds, stopped_by=True)
    finally:
        _install(previous)
        all_forked()
        _stop_workers(workers, signal.SIGKILL, 0.0)  # none should be left; if one is, it must not outlive us
        for helper in (server, forks.process if forks is not None else None):
            if helper is not None:
                _stop_workers({-1: helper}, signal.SIGTERM, 10.0)
        if output:
            output.close()


def _end_group(workers: Mapping[int, Worker], sig: signal.Signals, grace_seconds: float,
               stopped_by: bool = False) -> GroupResult:
    """Stop the workers still running with ``sig``; every rank's exit code, and the ranks the stop ended."""
    signalled = _stop_workers(workers, sig, grace_seconds)
    # Every rank's code: one that ended after the failure was seen, before the stop began, is a failure too.
    codes = {rank: int(worker.returncode) for rank, worker in workers.items() if worker.returncode is not None}
    # Stopped: ended by a signal (this one, or the SIGKILL after the grace). A rank that exits with a code of its
    # own says how it ended itself: most often it was leaving already (in the kernel's exit, not yet reaped).
    stopped = frozenset(rank for rank, code in signalled.items() if code < 0)
    return GroupResult(codes, sig if stopped_by else None, stopped)


def _start_store_server(nproc: int) -> tuple[subprocess.Popen[bytes], int]:
    """A store server process on a socket bound here to 127.0.0.1 (held, so no other program takes the port)."""
    with listening_socket(LOOPBACK, 0) as listener:
        fd = listener.fileno()
        server = subprocess.Popen([sys.executable, "-m", local_store_server.__name__, str(fd), str(nproc)],
                                  pass_fds=(fd,), start_new_session=True, preexec_fn=die_with_parent)
        return server, int(listener.getsockname()[1])


def _wait_for_all_or_a_failure(workers: Mapping[int, Worker],
                               poll_seconds: float = 0.05) -> dict[int, int]:
    """Exit codes of the workers that ended before all exited 0 or the first exited otherwise.

    Polls each worker rather than waiting for any child (``waitpid(-1)``), which would reap
    children that are not the group's when the launcher runs inside a larger program.
    """
    codes: dict[int, int] = {}
    while len(codes) < len(workers):
        # Every worker that has ended by now counts, not only the first failed one found: when
        # one is killed, the others fail moments later, and all are needed to tell which was first.
        for rank, worker in workers.items():
            if rank not in codes and worker.poll() is not None:
                codes[rank] = int(worker.returncode)
        if any(codes.values()):
            return codes
        if len(codes) < len(workers):
            time.sleep(poll_seconds)  # a stop signal's handler raises out of the sleep
    return codes


def _stop_workers(workers: Mapping[int, Worker], sig: signal.Signals,
                  grace_seconds: float) -> dict[int, int]:
    """Send ``sig`` to every running worker's session, wait up to ``grace_seconds``, then kill the rest."""
    running = {rank: worker for rank, worker in workers.items() if worker.poll() is None}
    _signal_all(running, sig, whole_session=True)
    deadline = time.monotonic() + grace_seconds
    for worker in running.values():
        with suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=max(0.0, deadline - time.monotonic()))
    late = {rank: worker for rank, worker in running.items() if worker.poll() is None}
    if late:
        _signal_all(late, signal.SIGKILL, whole_session=True)
        for worker in late.values():
            worker.wait()
    return {rank: int(worker.returncode) for rank, worker in running.items()}


def _signal_all(workers: Mapping[int, Worker], sig: int, whole_session: bool = False) -> None:
    """``sig`` to each worker still running (and to its own children, with ``whole_session``)."""
    for worker in workers.values():
        if worker.returncode is not None or worker.pid is None:  # ended, or a fork never made
            continue
        with suppress(ProcessLookupError, PermissionError):
            if whole_session:
                os.killpg(worker.pid, sig)  # start_new_session: the worker leads its own group
            else:
                os.kill(worker.pid, sig)


def _install(handlers: Mapping[int, Callable[..., object] | int]) -> dict[int, object]:
    """Set each signal's handler; return the ones they replace."""
    return {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}  # type: ignore[arg-type]


def die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the launcher dies (a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def name_process(name: str) -> None:
    """The name ``top``, ``ps -o comm`` and ``/proc/PID/comm`` show (15 bytes; Linux only)."""
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15])  # 15 = PR_SET_NAME
