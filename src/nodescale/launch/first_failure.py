"""Which rank failed first, on which host, and its last lines: the end of a failed job's log.

When one rank fails, the others fail a moment later ("lost its connection to another rank"),
and rank 0's complaint is usually the loudest. The first failure is found from what the
launchers report, in a labelled log (:mod:`nodescale.launch.rank_logs`):

- torchrun's summary on each node (``time``, ``host``, ``rank``, ``exitcode``): the earliest
  time wins; a rank torchrun itself stopped (SIGTERM) is a consequence, not a cause;
- srun's ``srun: error: HOST: task N: Exited with exit code C`` (per-gpu mode: task N is rank
  N; torchrun mode: node N, which names the host of that node's ranks);
- a rank killed by a signal nobody here sent (SIGKILL from the OOM killer, a segfault) comes
  before the ranks that then exited 1;
- ties (torchrun's times have one-second steps) go to the rank whose traceback came first: a
  rank's traceback is printed before it exits, so before its peers can notice.

A job that restarted its step (``launch --max-restarts``) holds every attempt in its log, and a
local ``ranks.log`` every launch of its run (a ``--resume``): only the lines from the last
``nodescale: restart N of M`` or ``nodescale: launch at`` line of each file on count (the Slurm
loop writes the restart line to the .err file too). PBS's mpiexec labels say no host: the job script's
``nodescale: mpiexec places P task(s) on each host, in this order: H1 H2 ...`` line does.

``python -m nodescale.launch.first_failure JOB LOG...`` prints the summary; the job scripts
run it after a failed step, so that it is the job log's last lines.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nodescale.launch.rank_logs import Line, parse, read_lines

LAST_LINES = 10

_SRUN = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.*)$")
_SRUN_CODE = re.compile(r"Exited with exit code (\d+)")
_FIELD = re.compile(r"^\s*(time|host|rank|exitcode)\s*:\s*(.*?)\s*$")
# Lines the job scripts print (nodescale.launch.restarts, nodescale.launch.rank_labels).
_ATTEMPT = re.compile(r"^nodescale: (?:restart \d+ of \d+|launch at )")
_PLACEMENT = re.compile(r"^nodescale: (?:mpiexec|the local launcher) places (\d+) task\(s\) on each host, "
                        r"in this order: (.*)$")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|\b\w*(Error|Exception): |^nodescale: .*error")


@dataclass
class Failure:
    """A rank that failed, as a launcher reported it."""

    rank: int
    host: str | None = None
    code: int | None = None  # negative: ended by that signal
    time: str = ""  # torchrun's, sortable as text
    order: int = 0  # where in the log the report was

    @property
    def stopped_by_launcher(self) -> bool:
        return self.code == -15


def _tasks(text: str) -> list[int]:
    """``0-2,5`` -> [0, 1, 2, 5]."""
    tasks: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        tasks += range(int(low), int(high or low) + 1)
    return tasks


def srun_reports(lines: Sequence[Line]) -> tuple[list[Failure], dict[int, str]]:
    """srun's failed tasks (``Terminated``: ended by srun itself, left out) and each task's host."""
    failures, hosts = [], {}
    for order, line in enumerate(lines):
        match = _SRUN.match(line.raw)
        if not match:
            continue
        host, what = match[1], match[3]
        code = _SRUN_CODE.search(what)
        for task in _tasks(match[2]):
            hosts[task] = host
            if "Terminated" in what:
                continue
            failures.append(Failure(task, host, int(code[1]) if code else -9, order=order))
    return failures, hosts


def torchrun_reports(lines: Sequence[Line]) -> list[Failure]:
    """The failed ranks of every node's torchrun summary, with the node's srun task in ``order``."""
    failures: list[Failure] = []
    current: dict[str, str] = {}

    def close(order: int) -> None:
        rank = re.match(r"(\d+)", current.get("rank", ""))
        code = re.match(r"(-?\d+)", current.get("exitcode", ""))
        if rank:
            failures.append(Failure(int(rank[1]), current.get("host"), int(code[1]) if code else None,
                                    current.get("time", ""), order))
        current.clear()

    for order, line in enumerate(lines):
        match = _FIELD.match(line.text)
        if not match:
            continue
        if match[1] == "time" and current:
            close(order)
        current[match[1]] = match[2]
    if current:
        close(len(lines))
    return failures


def last_attempt(raws: list[str]) -> list[str]:
    """One log file's lines from the last restart or launch on (all of them where there was one attempt)."""
    starts = [index for index, raw in enumerate(raws) if _ATTEMPT.match(raw)]
    return raws[starts[-1]:] if starts else raws


def placed_hosts(raws: Sequence[str]) -> dict[int, str]:
    """Each task's host, from the last placement line (blocks of P tasks per host): the PBS script's, or the
    local launcher's in ranks.log, which heads each launch."""
    for raw in reversed(raws):
        match = _PLACEMENT.match(raw)
        if match:
            per_host = int(match[1])
            return {index * per_host + slot: host for index, host in enumerate(match[2].split())
                    for slot in range(per_host)}
    return {}


def first_failure(lines: Sequence[Line], placed: dict[int, str] | None = None) -> Failure | None:
    """The rank that failed first, or None where nothing in the log says one did.

    ``placed``: each launcher task's host where the labels do not say it (:func:`placed_hosts`).
    """
    from_srun, srun_hosts = srun_reports(lines)
    task_hosts = {**(placed or {}), **srun_hosts}
    torchrun = any(line.node is not None for line in lines)
    candidates = torchrun_reports(lines) if torchrun else from_srun
    node_of = {line.rank: line.node for line in lines if line.rank is not None and line.node is not None}
    if torchrun:
        for failure in candidates:  # torchrun knows its machine's name; Slurm knows the node's
            failure.host = task_hosts.get(node_of.get(failure.rank, -1), failure.host)
    first_error = {}
    for order, line in enumerate(lines):
        if line.rank is not None and line.rank not in first_error and _TRACEBACK.search(line.text):
            first_error[line.rank] = order
    if not candidates:  # no launcher said: the first rank that printed a traceback
        candidates = [Failure(rank, order=order) for rank, order in first_error.items()]
    causes = [failure for failure in candidates if not failure.stopped_by_launcher] or candidates
    killed = [failure for failure in causes if failure.code is not None and failure.code < 0]
    causes = killed or causes
    if not causes:
        return None
    failure = min(causes, key=lambda f: (f.time, first_error.get(f.rank, len(lines)), f.order))
    failure.host = failure.host or task_hosts.get(node_of.get(failure.rank, -1) if torchrun else failure.rank)
    return failure


def summary(lines: Sequence[Line], job: str, placed: dict[int, str] | None = None) -> list[str]:
    """The lines that end a failed job's log: the first failed rank's last lines, then who it was."""
    failure = first_failure(lines, placed)
    if failure is None:
        return [f"nodescale: the job failed; no rank's failure was found in its log: `nodescale logs {job}`"]
    own = [line.text for line in lines if line.rank == failure.rank][-LAST_LINES:]
    head = [f"nodescale: rank {failure.rank}'s last lines:", *(f"nodescale: | {text}" for text in own)]
    code = "" if failure.code is None else f", exit code {failure.code}"
    where = failure.host or "an unknown host"
    return [*head, f"nodescale: the job failed: rank {failure.rank} on {where} failed first{code}; its last "
                   f"lines are above; all of them: `nodescale logs {job} --rank {failure.rank}`"]


def main(argv: Sequence[str]) -> int:
    """``python -m nodescale.launch.first_failure JOB LOG...``: print the summary of the logs."""
    job, *paths = argv
    print("\n".join(summary_of_logs([Path(path) for path in paths], job)), flush=True)
    return 0


def summary_of_logs(paths: Sequence[Path], job: str, torchrun: bool | None = None) -> list[str]:
    """:func:`summary` of a job's log files: their last attempt, and the hosts placed anywhere in them."""
    files = [read_lines(path) for path in paths]
    raws = [raw for lines in files for raw in last_attempt(lines)]
    return summary(parse(raws, torchrun), job, placed_hosts([raw for lines in files for raw in lines]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
