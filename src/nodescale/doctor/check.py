"""One row of the doctor's table: a named check, its status, what was found and what to do.

Statuses are ``ok``, ``warn`` (works, but probably not what you want) and ``fail`` (the job
would hang, crash or run with the wrong processes). The exit code of ``nodescale doctor`` is 1
when any row fails, else 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from nodescale.distributed.rank_labels import rank_ranges

OK = "ok"
WARN = "warn"
FAIL = "fail"
STATUSES = (OK, WARN, FAIL)

EXIT_OK = 0
EXIT_FAIL = 1


@dataclass(frozen=True)
class Check:
    """A check's outcome. ``blocking`` marks a failure that would stop a process group from
    starting (rank 0 then skips the all_reduce on every rank instead of letting it hang)."""

    name: str
    status: str
    detail: str
    hint: str = ""
    blocking: bool = False

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status {self.status!r} is not one of {', '.join(STATUSES)}")

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-ready data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Check:
        """The row written by :meth:`to_dict`."""
        return cls(str(data["name"]), str(data["status"]), str(data["detail"]), str(data.get("hint", "")),
                   bool(data.get("blocking", False)))


def ok(name: str, detail: str) -> Check:
    """A passing row (no hint needed)."""
    return Check(name, OK, detail)


def warn(name: str, detail: str, hint: str) -> Check:
    """A row for something that works but is probably a mistake."""
    return Check(name, WARN, detail, hint)


def fail(name: str, detail: str, hint: str, *, blocking: bool = False) -> Check:
    """A row for something that breaks the job; ``blocking`` if no process group could start."""
    return Check(name, FAIL, detail, hint, blocking)


def worst(checks: Iterable[Check]) -> str:
    """The most severe status among ``checks`` (``ok`` for none)."""
    found = {check.status for check in checks}
    return FAIL if FAIL in found else WARN if WARN in found else OK


def exit_code(checks: Iterable[Check]) -> int:
    """1 when any check failed, else 0."""
    return EXIT_FAIL if worst(checks) == FAIL else EXIT_OK


def counts(checks: Iterable[Check]) -> dict[str, int]:
    """How many rows have each status."""
    result = dict.fromkeys(STATUSES, 0)
    for check in checks:
        result[check.status] += 1
    return result


def plural(count: int, word: str, many: str | None = None) -> str:
    """``"1 node"``, ``"2 nodes"``; ``many`` for irregular plurals (process -> processes)."""
    return f"{count} {word if count == 1 else many or word + 's'}"




def merge_rank_rows(rows_by_rank: Mapping[int, Sequence[Check]], world_size: int) -> list[Check]:
    """Collapse rows that several ranks produced alike into one row naming those ranks.

    A check run on each rank's own facts (its interfaces, its variables) would otherwise repeat
    the same row once per rank: 512 identical rows hide the one that differs. Rows keep the
    order in which they first appear; the detail is prefixed with "all ranks", "rank 3" or
    "ranks 0-3,7".
    """
    order: list[Check] = []
    ranks_of: dict[Check, list[int]] = {}
    for rank in sorted(rows_by_rank):
        for row in rows_by_rank[rank]:
            if row not in ranks_of:
                ranks_of[row] = []
                order.append(row)
            ranks_of[row].append(rank)
    merged = []
    for row in order:
        ranks = ranks_of[row]
        if len(ranks) == world_size and world_size > 1:
            where = "all ranks"
        elif len(ranks) == 1:
            where = f"rank {ranks[0]}"
        else:
            where = f"ranks {rank_ranges(ranks)}"
        merged.append(replace(row, detail=f"{where}: {row.detail}"))
    return merged
