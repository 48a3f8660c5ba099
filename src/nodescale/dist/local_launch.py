"""Start N local worker processes the way ``torchrun --standalone`` does.

Uses torch's elastic launcher (an agent, a c10d rendezvous on a free local
port, worker monitoring, restarts), so workers see exactly the environment
torchrun gives them and the same entry point runs unchanged under torchrun.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from nodescale.errors import EXIT_USER_ERROR

# Workers (nodescale.train.worker) write their user errors into this directory and the
# launcher prints each distinct one once, instead of N ranks printing the same lines.
ERROR_DIR_VARIABLE = "NODESCALE_ERROR_DIR"


def threads_per_process(nproc: int, cpus: int | None = None) -> int:
    """CPU threads each of ``nproc`` processes should use: the cores split evenly.

    Left alone, every process starts one thread per core, and N processes on
    C cores fight over them (N x C threads), which is slower than either.
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, nproc))


def launch_local(command: Sequence[str], nproc: int, max_restarts: int = 0) -> int:
    """Run ``command`` in ``nproc`` local processes, torchrun-style; return the job's exit code.

    Exit code 2 when every failed worker exited 2 (they printed the user
    error themselves), 1 for any other failure, 0 on success.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every worker failure with its own traceback-like report;
    # nodescale reports failures itself: each user error once, exit codes per rank.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # port 0: the store picks a free port, so jobs never clash
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )
    with tempfile.TemporaryDirectory(prefix="nodescale-errors-") as error_dir:
        os.environ[ERROR_DIR_VARIABLE] = error_dir
        try:
            elastic_launch(config, command[0])(*command[1:])
        except ChildFailedError as exc:
            codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
            _print_user_errors(Path(error_dir))
            # When one rank stops on a user error the agent terminates the others
            # (negative exit codes: killed by a signal); that is still the user's error.
            if EXIT_USER_ERROR in codes.values() and all(
                code == EXIT_USER_ERROR or code < 0 for code in codes.values()
            ):
                return EXIT_USER_ERROR
            details = ", ".join(f"rank {rank} exit code {code}" for rank, code in sorted(codes.items()))
            print(f"nodescale: worker processes failed: {details}", file=sys.stderr)
            return 1
        finally:
            del os.environ[ERROR_DIR_VARIABLE]
    return 0


def run_cli_locally(argv: Sequence[str], nproc: int) -> int:
    """``nodescale ARGV`` in ``nproc`` local processes; each finds itself started torchrun-style.

    For subcommands that run on every rank (doctor, bench comm): the workers
    parse the same arguments, see a launcher in their environment and do their
    rank's part instead of launching again.
    """
    sys.stdout.flush()
    return launch_local([sys.executable, "-u", "-m", "nodescale", *argv], nproc)


def hand_over_user_error(message: str) -> bool:
    """In a worker of :func:`launch_local`: leave ``message`` for the launcher to print once.

    Returns False outside such a worker (the caller prints it).
    """
    error_dir = os.environ.get(ERROR_DIR_VARIABLE)
    if not error_dir:
        return False
    Path(error_dir, f"rank-{os.environ.get('RANK', '0')}.txt").write_text(message)
    return True


def _print_user_errors(error_dir: Path) -> None:
    """Each distinct user error once, with the ranks that hit it."""
    ranks_by_message: dict[str, list[int]] = {}
    for path in error_dir.glob("rank-*.txt"):
        ranks_by_message.setdefault(path.read_text(), []).append(int(path.stem.split("-")[1]))
    for message, ranks in ranks_by_message.items():
        who = "rank" if len(ranks) == 1 else "ranks"
        print(f"nodescale: error ({who} {', '.join(map(str, sorted(ranks)))}): {message}", file=sys.stderr)
