"""Processes of a test, read from /proc (Linux; no psutil): descendants, workers by rank, orphans."""

from __future__ import annotations

import os
from pathlib import Path


def _parent_of(entry: Path) -> int | None:
    try:
        # The command name may hold spaces and parentheses: the parent id follows the last ')'.
        return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid``, so that a test signals only its own processes."""
    by_parent: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (parent := _parent_of(entry)) is not None:
            by_parent.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        children = by_parent.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def worker_of_rank(parent: int, rank: int) -> int | None:
    """The pid of the training worker of ``rank`` among ``parent``'s descendants.

    A rank forked by the local launcher's fork server is named ``nodescale-rN``; one started
    afresh (torchrun, srun) has the worker module on its command line and RANK in its environment.
    """
    for pid in descendants(parent):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if name == f"nodescale-r{rank}" or (b"nodescale.train.worker" in cmdline
                                            and f"RANK={rank}".encode() in environ):
            return pid
    return None


def workers_in(directory: Path) -> list[int]:
    """Training workers still running with ``directory`` as their working directory (orphans included)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (b"nodescale.train.worker" in (entry / "cmdline").read_bytes()
                    and Path(os.readlink(entry / "cwd")) == directory):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
