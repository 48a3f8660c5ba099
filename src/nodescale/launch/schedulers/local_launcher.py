"""Start N local worker processes the way ``torchrun --standalone`` does, and restart them.

The workers are started by :mod:`nodescale.launch.schedulers.local_worker_group` with exactly
torchrun's environment, so the same entry point runs unchanged under torchrun; this launcher does
not import torch, which lets the workers start about one ``import torch`` sooner.

Restarts (``max_restarts``) are a loop around the group: torch's agent restarts a group
whatever the exit code, while a user error (exit code 2) would only fail the same way again,
so it stops the job at once. Restarted workers see ``NODESCALE_RESTART_COUNT`` (and
torchrun's own restarts set ``TORCHELASTIC_RESTART_COUNT``); either way
:func:`current_restart` tells them to resume from the newest checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Collection, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nodescale.errors import EXIT_USER_ERROR, UserError, program_not_found
from nodescale.stop_signals import EXIT_REQUEUE, REQUEUE_FILE_VARIABLE, marker_step

if TYPE_CHECKING:
    from nodescale.launch.schedulers.local_rank_output import RankOutput

# Workers (nodescale.train.worker) write their user errors into this directory and the
# launcher prints each distinct one once, instead of N ranks printing the same lines.
ERROR_DIR_VARIABLE = "NODESCALE_ERROR_DIR"
# Set by launch_local for the workers of a restarted attempt: which restart, out of how many, and why.
RESTART_COUNT_VARIABLE = "NODESCALE_RESTART_COUNT"
MAX_RESTARTS_VARIABLE = "NODESCALE_MAX_RESTARTS"
RESTART_REASON_VARIABLE = "NODESCALE_RESTART_REASON"


@dataclass(frozen=True)
class Restart:
    """This worker belongs to a group started again after a failure."""

    count: int  # 1 for the first restart
    limit: int | None  # the restart budget, where the launcher says it
    reason: str | None  # e.g. "rank 1 exited with -9 (SIGKILL)", where the launcher knows it

    def describe(self) -> str:
        """``restart 1 of 3 after rank 1 exited with -9 (SIGKILL)``."""
        text = f"restart {self.count}" + (f" of {self.limit}" if self.limit else "")
        return text + (f" after {self.reason}" if self.reason else " (torchrun's agent restarted every rank)")


def current_restart() -> Restart | None:
    """The restart this worker process is part of, or None on a job's first attempt.

    nodescale's launcher sets ``NODESCALE_RESTART_COUNT``; torchrun's agent
    (``torchrun --max-restarts N``) sets ``TORCHELASTIC_RESTART_COUNT``.
    """
    def number(name: str) -> int:
        text = os.environ.get(name, "")
        return int(text) if text.isdigit() else 0

    own = number(RESTART_COUNT_VARIABLE)
    count = own or number("TORCHELASTIC_RESTART_COUNT")
    if count == 0:
        return None
    limit = number(MAX_RESTARTS_VARIABLE) if own else number("TORCHELASTIC_MAX_RESTARTS")
    return Restart(count, limit or None, os.environ.get(RESTART_REASON_VARIABLE) if own else None)


def threads_per_process(nproc: int, cpus: int | None = None) -> int:
    """CPU threads each of ``nproc`` processes should use: the cores split evenly.

    Left alone, every process starts one thread per core, and N processes on
    C cores fight over them (N x C threads), which is slower than either.
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, nproc))


def launch_local(command: Sequence[str], nproc: int, max_restarts: int = 0, store_process: bool = False,
                 preload: Sequence[str] = (), log_dir: Path | None = None) -> int:
    """Run ``command`` in ``nproc`` local processes, torchrun-style; return the job's exit code.

    When a worker fails for any reason but a user error, every worker is
    stopped and all are started again, up to ``max_restarts`` times. Exit code
    2 when every failed worker exited 2 (they printed the user error
    themselves), 1 for any other failure, 0 on success, 128 + N when signal N
    stopped the launcher. ``store_process`` (for commands that are not nodescale's) and ``preload``
    (modules a ``python -m`` command's ranks are forked after): see
    :func:`~nodescale.launch.schedulers.local_worker_group.run_worker_group`. ``log_dir``: with
    ``nproc`` > 1, each rank's lines are labelled and kept in ``log_dir/ranks.log`` as well
    (:mod:`~nodescale.launch.schedulers.local_rank_output`).
    """
    from nodescale.launch.schedulers.local_rank_output import TERMINAL_VARIABLE, RankOutput, note, open_log

    if log_dir is not None and nproc > 1 and shutil.which(command[0]) is None:
        raise program_not_found(command[0])  # before ranks.log: a mistyped command leaves no job folder behind
    log = open_log(log_dir, nproc) if log_dir is not None and nproc > 1 else None
    terminal = log is not None and sys.stdout.isatty()
    if log is not None:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")  # a rank's lines reach the terminal as they are printed
    if terminal:
        os.environ[TERMINAL_VARIABLE] = str(shutil.get_terminal_size().columns)
    try:
        return _launch_local(command, nproc, max_restarts, store_process, preload,
                             (lambda: RankOutput(log, nproc)) if log else (lambda: None),
                             lambda line: note(log, line))
    finally:
        if log is not None:
            with suppress(OSError):  # a full disk
                log.close()


def _launch_local(command: Sequence[str], nproc: int, max_restarts: int, store_process: bool,
                  preload: Sequence[str], output: Callable[[], RankOutput | None], note: Callable[[str], None]) -> int:
    from nodescale.launch.schedulers.local_worker_group import run_worker_group
    from nodescale.launch.schedulers.temp_files import remove_at_exit

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc)))
    restart: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="nodescale-errors-") as error_dir:
        remove_at_exit(error_dir)  # also when this launcher is killed outright
        # Rank 0's requeue marker: the job script's where one runs this launcher, else one of its own.
        marker = Path(os.environ.get(REQUEUE_FILE_VARIABLE, "").strip() or Path(error_dir, "requeue"))
        for attempt in range(max_restarts + 1):
            result = run_worker_group(command, nproc, {ERROR_DIR_VARIABLE: error_dir,
                                                       REQUEUE_FILE_VARIABLE: str(marker), **restart},
                                      store_process=store_process, preload=preload, output=output())
            if result.stopped_by is not None:
                # SIGTERM/SIGINT to this launcher: passed on to the workers, whose stop handlers
                # checkpoint within the grace period, and they were stopped.
                print(f"nodescale: stopped by {result.stopped_by.name}; the workers were told to stop",
                      file=sys.stderr)
                return 128 + int(result.stopped_by)
            codes = result.failures
            if not codes:
                return 0
            user_error = _print_user_errors(Path(error_dir)) or EXIT_USER_ERROR in codes.values()
            # When one rank stops on a user error (a full disk, say) the others lose their peer
            # (exit code 1), maybe first, or are stopped (negative: killed by a signal), maybe
            # the erring rank too; that is still the user's error, and restarting would meet it again.
            if user_error and all(code in (EXIT_USER_ERROR, 1) or code < 0 for code in codes.values()):
                return EXIT_USER_ERROR
            reason = describe_failure(codes, result.stopped)
            # Ranks that stopped on an agreed stop signal (preemption) were asked to stop, not broken:
            # the requeue code is passed on. Only with rank 0's marker: exit code 3 alone proves no
            # checkpoint (any program may exit 3). (The others are ended with SIGTERM once the first
            # has exited; by then they have passed the barrier after the checkpoint.)
            stopped_step = marker_step(marker.read_text()) if marker.is_file() else None
            if stopped_step is not None and all(code in (EXIT_REQUEUE, -signal.SIGTERM) for code in codes.values()):
                print(f"nodescale: stopped for requeue at a checkpoint of step {stopped_step} ({reason})",
                      file=sys.stderr)
                return EXIT_REQUEUE
            if attempt == max_restarts or stopped_step is not None:
                print(f"nodescale: worker processes failed: {reason}", file=sys.stderr)
                note(f"nodescale: worker processes failed: {reason}")
                return 1
            print(f"nodescale: {reason}; restarting all {nproc} processes from the newest checkpoint "
                  f"(restart {attempt + 1} of {max_restarts})", file=sys.stderr)
            sys.stderr.flush()
            # The line the failure summary reads the log from (first_failure.last_attempt).
            note(f"nodescale: restart {attempt + 1} of {max_restarts} after {reason}")
            _clear(Path(error_dir))
            restart = {RESTART_COUNT_VARIABLE: str(attempt + 1), MAX_RESTARTS_VARIABLE: str(max_restarts),
                       RESTART_REASON_VARIABLE: reason}
    return 1  # not reached: every attempt returns


def describe_failure(codes: dict[int, int], stopped: Collection[int] = ()) -> str:
    """``rank 1 exited with -9 (SIGKILL)``, ``ranks 0 and 1 exited with 1``: the ranks that failed first, not
    those that followed.

    Once one worker fails the others are ended (``stopped``: by nodescale's launcher; a
    SIGTERM under torchrun's agent), and a rank whose peer died fails on its own a moment
    later with the generic exit code 1 ("lost its connection"). So where a rank was ended by a
    signal nobody here sent (a SIGKILL from the OOM killer, a segfault), the ranks that exited
    1 are left out; the ranks the launcher stopped are named only when nothing else failed.
    """
    own = {rank: code for rank, code in codes.items() if rank not in stopped and code != -signal.SIGTERM} or codes
    crashed = any(code < 0 for code in own.values())
    first = {rank: code for rank, code in own.items() if code != 1} if crashed else own
    ranks_by_code: dict[int, list[int]] = {}
    for rank, code in sorted(first.items()):
        ranks_by_code.setdefault(code, []).append(rank)
    parts = []
    for code, ranks in ranks_by_code.items():
        names = [str(rank) for rank in ranks]
        who = f"rank {names[0]}" if len(names) == 1 else f"ranks {', '.join(names[:-1])} and {names[-1]}"
        text = f"{who} exited with {code}"
        if code < 0:
            try:
                text += f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        parts.append(text)
    return ", ".join(parts)


def _clear(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def run_cli_locally(argv: Sequence[str], nproc: int) -> int:
    """``nodescale ARGV`` in ``nproc`` local processes; each finds itself started torchrun-style.

    For subcommands that run on every rank (doctor, bench comm): the workers
    parse the same arguments, see a launcher in their environment and do their
    rank's part instead of launching again.
    """
    sys.stdout.flush()
    return launch_local([sys.executable, "-u", "-m", "nodescale", *argv], nproc, preload=("torch.distributed",))


def command_line(nproc: int, command: Sequence[str], max_restarts: int = 0, log_dir: Path | None = None) -> list[str]:
    """The command that runs ``command`` in ``nproc`` local processes (what ``nodescale launch`` executes)."""
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    log = [f"--log-dir={log_dir}"] if log_dir is not None and nproc > 1 else []
    return [sys.executable, "-m", __name__, f"--nproc-per-node={nproc}", *restarts, *log, "--", *command]


def main(argv: Sequence[str]) -> int:
    """``python -m nodescale.launch.schedulers.local_launcher --nproc-per-node=N -- COMMAND...``."""
    import argparse

    parser = argparse.ArgumentParser(description="nodescale's local launcher: COMMAND in N local processes")
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, help="keep the ranks' labelled lines in LOG_DIR/ranks.log")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        # Any script's rank 0 would serve the store on every interface: a store process serves it on loopback.
        return launch_local(command, args.nproc_per_node, args.max_restarts, store_process=True,
                            log_dir=args.log_dir)
    except UserError as exc:
        print(f"nodescale: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


def report_user_error(exc: UserError) -> None:
    """Say ``exc`` once: hand it over to the launcher (which prints each distinct error once), or print it.

    Called again on the way out of a process that reported it already, it does nothing. A rank of
    several names itself: its peers' lines (if any) say only that they lost one.
    """
    if exc.reported:
        return
    exc.reported = True
    if not hand_over_user_error(str(exc)):
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
        who = f" (rank {rank})" if rank is not None and world.isdigit() and int(world) > 1 else ""
        print(f"nodescale: error{who}: {exc}", file=sys.stderr, flush=True)


def hand_over_user_error(message: str) -> bool:
    """In a worker of :func:`launch_local`: leave ``message`` for the launcher to print once.

    Returns False outside such a worker (the caller prints it).
    """
    error_dir = os.environ.get(ERROR_DIR_VARIABLE)
    if not error_dir:
        return False
    Path(error_dir, f"rank-{os.environ.get('RANK', '0')}.txt").write_text(message)
    return True


def ranks_with_user_errors() -> list[int]:
    """In a worker: the ranks that have handed over a user error so far (none outside such a worker).

    A rank hands its error over before it leaves the process group, so a peer that has lost
    its connection to that rank finds it here and can leave without a message of its own.
    """
    error_dir = os.environ.get(ERROR_DIR_VARIABLE)
    if not error_dir:
        return []
    return sorted(int(path.stem.split("-")[1]) for path in Path(error_dir).glob("rank-*.txt"))


def _print_user_errors(error_dir: Path) -> bool:
    """Each distinct user error once, with the ranks that hit it; whether there was one."""
    ranks_by_message: dict[str, list[int]] = {}
    for path in error_dir.glob("rank-*.txt"):
        ranks_by_message.setdefault(path.read_text(), []).append(int(path.stem.split("-")[1]))
    for message, ranks in ranks_by_message.items():
        who = "rank" if len(ranks) == 1 else "ranks"
        print(f"nodescale: error ({who} {', '.join(map(str, sorted(ranks)))}): {message}", file=sys.stderr)
    return bool(ranks_by_message)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
