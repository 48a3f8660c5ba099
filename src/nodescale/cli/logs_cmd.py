"""``nodescale logs JOB [--rank R] [--grep P] [--follow] [--failure]``: a job's log, by rank."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nodescale.errors import UserError
from nodescale.launch.rank_logs import Line

# A job directory's logs, newest first: Slurm's, nodescale's copy of PBS's, PBS's own, and a run or job
# directory's ranks.log (nodescale's local launcher with several ranks: local_rank_output).
_LOG_NAMES = re.compile(r"^(slurm-\d+\.out|pbs-\d+\.log|.+\.o\d+|ranks\.log)$")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    logs = subparsers.add_parser("logs", help="a job's log, each line with its rank: one rank, a pattern, or live")
    logs.add_argument("job", metavar="JOB",
                      help="a job id as `nodescale jobs` lists it, or a log file or job directory")
    logs.add_argument("--rank", type=_rank, metavar="R", help="only rank R's lines (without their labels)")
    logs.add_argument("--grep", metavar="REGEX", help="only lines whose text matches this regular expression")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    logs.add_argument("--failure", action="store_true",
                      help="which rank failed first, on which host, and its last lines")
    logs.set_defaults(handler=show_logs)


def _rank(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank (0, 1, 2, ...)")
    return int(text)


@dataclass(frozen=True)
class JobLogs:
    """Where a job's output is, what kind of job wrote it, and how to tell that it has ended."""

    name: str  # the job id, or the path given
    paths: list[Path]
    torchrun: bool | None  # None: guess from the labels
    ended: Callable[[], bool]


def find_logs(job: str) -> JobLogs:
    """The logs of a job id from the registry, or of a log file or job directory; UserError otherwise."""
    from nodescale.launch.job_log import find
    from nodescale.launch.rank_labels import PBS_LOG_NAME
    from nodescale.launch.rank_logs import script_is_torchrun
    from nodescale.launch.schedulers.batch import ENDED
    from nodescale.launch.schedulers.table import BATCH

    record = find(job)
    if record is not None:
        log = Path(record.log)
        if record.scheduler == "pbs":
            copy = log.parent / PBS_LOG_NAME.format(job_number=record.job_id.split(".")[0])
            paths = [copy if copy.exists() or not log.exists() else log]
        else:
            paths = [log, log.with_suffix(".err")]

        unlisted = [0]

        def ended() -> bool:
            state = BATCH[record.scheduler].status([record.job_id]).get(record.job_id)
            # Not listed: gone long ago, or a scheduler that did not answer in time. Three polls in a row decide.
            unlisted[0] = unlisted[0] + 1 if state is None else 0
            return unlisted[0] >= 3 or state in ENDED

        return JobLogs(record.job_id, paths, script_is_torchrun(Path(record.script)), ended)
    path = Path(job)
    if path.is_dir():
        found = sorted((p for p in path.iterdir() if _LOG_NAMES.match(p.name)), key=lambda p: p.stat().st_mtime)
        if not found:
            raise UserError(f"job directory {job!r}",
                            "holds no job log (slurm-ID.out, pbs-ID.log, NAME.oID, ranks.log)")
        path = found[-1]
    if path.is_file():
        errors = path.with_suffix(".err") if path.suffix == ".out" else None
        return JobLogs(str(path), [path, *([errors] if errors and errors.exists() else [])], None, lambda: False)
    raise UserError(f"job {job!r}", "is neither a job nodescale submitted on this account nor a log file",
                    "`nodescale jobs --all` lists the jobs it knows")


def show_logs(args: argparse.Namespace) -> int:
    from nodescale.launch import first_failure, rank_logs

    logs = find_logs(args.job)
    keep = rank_logs.line_filter(args.rank, args.grep)
    if args.failure:
        print("\n".join(first_failure.summary_of_logs(logs.paths, logs.name, logs.torchrun)))
        return 0
    if args.follow:
        torchrun = logs.torchrun
        try:
            for _, raw in rank_logs.follow(logs.paths, logs.ended):
                if torchrun is None and rank_logs.looks_torchrun([raw]):
                    torchrun = True
                _show(rank_logs.parse_line(raw, bool(torchrun)), args.rank, keep)
        except KeyboardInterrupt:
            pass
        return 0
    if not any(path.exists() for path in logs.paths):
        raise UserError(f"job {logs.name}", "has no log yet", "it may still be queued: `nodescale jobs`")
    for path in logs.paths:
        raws = rank_logs.read_lines(path)
        for line in rank_logs.parse(raws, logs.torchrun):
            _show(line, args.rank, keep)
    return 0


def _show(line: Line, rank: int | None, keep: Callable[[Line], bool]) -> None:
    """The line as the log holds it; with --rank, without the labels, which all say the same."""
    if keep(line):
        print(line.text if rank is not None else line.raw, flush=True)
