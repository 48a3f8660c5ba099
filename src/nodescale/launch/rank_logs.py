"""A job's log, line by line, with the rank each line came from (``nodescale logs``).

The job scripts label every line (:mod:`nodescale.launch.rank_labels`): the launcher's label
(``srun --label`` and PALS ``--label``: ``1: text``; MPICH ``-prepend-rank``: ``[1] text``;
Open MPI ``--tag-output``: ``[1,1]<stdout>:text``) is the task's index, and in torchrun mode,
where a task is a node's torchrun, torchrun's own prefix (``[rank3]:text``) inside it names
the rank. A line with only the outer label is then that node's torchrun speaking, not a rank.
Lines without a label are the batch script's own.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from nodescale.errors import UserError

_OUTER = (
    re.compile(r"^\s*(\d+): "),  # srun --label, PALS --label
    re.compile(r"^\[(\d+)\] "),  # MPICH -prepend-rank
    re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>: ?"),  # Open MPI --tag-output
)
_TORCHRUN = re.compile(r"^\[rank(\d+)\]: ?")
# The header comment of a job script says its mode (nodescale.launch.shell.header_lines).
_SCRIPT_MODE = re.compile(r"^# Job script written by .*mode (\S+)\.$", re.MULTILINE)


@dataclass(frozen=True)
class Line:
    """One line of a job's log: the rank that printed it (None: the script, or a node's torchrun)."""

    rank: int | None
    node: int | None  # torchrun mode: the node (task) whose torchrun printed or relayed the line
    text: str  # without the labels
    raw: str


def parse_line(raw: str, torchrun: bool) -> Line:
    """``raw`` with its labels read off; ``torchrun``: the outer label is a node, not a rank."""
    outer, text = _outer_label(raw)
    inner = _TORCHRUN.match(text)
    if inner:
        text = text[inner.end():]
        again = _TORCHRUN.match(text)  # torch's own prefix of an uncaught exception's lines
        if again and again[1] == inner[1]:
            text = text[again.end():]
        return Line(int(inner[1]), outer, text, raw)
    if torchrun:
        return Line(None, outer, text, raw)
    return Line(outer, None, text, raw)


def _outer_label(raw: str) -> tuple[int | None, str]:
    """The launcher's task label of a line, and the rest of it."""
    for pattern in _OUTER:
        match = pattern.match(raw)
        if match:
            return int(match[1]), raw[match.end():]
    return None, raw


def looks_torchrun(raws: Iterable[str]) -> bool:
    """Whether any line carries torchrun's rank prefix (then outer labels are nodes)."""
    return any(_TORCHRUN.match(_outer_label(raw)[1]) for raw in raws)


def parse(raws: list[str], torchrun: bool | None = None) -> list[Line]:
    """Every line of a log, labels read off; ``torchrun`` None: guessed from the lines themselves."""
    mode = looks_torchrun(raws) if torchrun is None else torchrun
    return [parse_line(raw, mode) for raw in raws]


def script_is_torchrun(script: Path) -> bool | None:
    """The mode a job script's header states: torchrun or not; None where it cannot be read."""
    try:
        match = _SCRIPT_MODE.search(script.read_text(errors="replace")[:2000])
    except OSError:
        return None
    return match[1] == "torchrun" if match else None


def line_filter(rank: int | None, pattern: str | None) -> Callable[[Line], bool]:
    """Keep rank ``rank``'s lines (every line with None) whose text matches ``pattern``; UserError for a bad regex."""
    try:
        regex = re.compile(pattern) if pattern is not None else None
    except re.error as exc:
        raise UserError(f"--grep {pattern!r}", f"is not a regular expression: {exc}",
                        "escape special characters (\\. \\[ \\( ...), or use a plain word") from None

    def keep(line: Line) -> bool:
        if rank is not None and line.rank != rank:
            return False
        return regex is None or regex.search(line.text) is not None

    return keep


def read_lines(path: Path) -> list[str]:
    """A log file's lines (undecodable bytes replaced); none for a file not written yet."""
    try:
        return path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def follow(paths: list[Path], ended: Callable[[], bool], poll_s: float = 1.0) -> Iterator[tuple[Path, str]]:
    """Each whole line appended to ``paths``, as it comes, until ``ended()`` and nothing is left to read.

    Starts at each file's beginning (what is there already, then what follows), like ``tail -n +1 -f``.
    """
    offsets = dict.fromkeys(paths, 0)
    partial = dict.fromkeys(paths, "")
    while True:
        done = ended()  # asked before reading: lines written before the job ended are all read below
        for path in paths:
            try:
                with open(path, "rb") as handle:
                    handle.seek(offsets[path])
                    chunk = handle.read()
            except FileNotFoundError:
                continue
            offsets[path] += len(chunk)
            *whole, partial[path] = (partial[path] + chunk.decode(errors="replace")).split("\n")
            for raw in whole:
                yield path, raw
        if done:
            for path, rest in partial.items():
                if rest:
                    yield path, rest
            return
        time.sleep(poll_s)
