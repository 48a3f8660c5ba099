"""The numbers one launcher's variables give, and reading them so errors name the variable.

A detector in :mod:`nodescale.distributed.launchers` fills in a :class:`Layout` (rank, local rank,
world size, node, and which variable each number came from) using :func:`int_var`,
:func:`first_set` and :func:`first_value`. :meth:`Layout.check` then rejects numbers that
contradict each other, naming the variables, since a hand-edited job script is the usual cause.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from nodescale.errors import UserError


@dataclass(frozen=True)
class RankPlace:
    """Where one process sits in its job: the six numbers every launcher gives."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int

    def place(self) -> dict[str, int]:
        """The six numbers alone, as keywords for another record of this process."""
        return {f.name: getattr(self, f.name) for f in fields(RankPlace)}


@dataclass(frozen=True)
class Layout(RankPlace):
    """What one detector read, with the variable each number came from (for error messages)."""

    source: str
    names: dict[str, str]
    hosts: Callable[[], list[str]] = field(default=lambda: [])

    def check(self) -> None:
        self._below("rank", "world_size")
        self._below("local_rank", "local_world_size")
        self._below("node_rank", "num_nodes")
        if self.local_world_size > self.world_size:
            self._fail("local_world_size", f"cannot exceed {self._show('world_size')}")

    def _below(self, small: str, big: str) -> None:
        if getattr(self, small) >= getattr(self, big):
            self._fail(small, f"must be less than {self._show(big)}")

    def _show(self, name: str) -> str:
        return f"{self.names.get(name, name)}={getattr(self, name)}"

    def _fail(self, name: str, rule: str) -> None:
        raise UserError(
            f"{self._show(name)} (from {self.source})",
            rule,
            "these variables are set by the launcher; a job script that exports RANK, WORLD_SIZE "
            "or SLURM_* by hand is the usual cause",
        )


def int_var(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    """An integer variable, with the variable and its value named when it is not one."""
    if name not in env:
        raise missing(name, "the launcher")
    raw = env[name]
    if not re.fullmatch(r"[+-]?\d+", raw.strip()):
        raise UserError(f"{name}={raw!r}", "is not an integer")
    value = int(raw.strip())
    if value < minimum:
        raise UserError(
            f"{name}={raw!r}", "must not be negative" if minimum == 0 else f"must be at least {minimum}"
        )
    return value


def first_set(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` that is set to something non-blank."""
    return next((name for name in names if env.get(name, "").strip()), None)


def first_value(env: Mapping[str, str], *names: str) -> str | None:
    name = first_set(env, *names)
    return env[name] if name else None


def missing(name: str, launcher: str) -> UserError:
    return UserError(
        name,
        f"is not set, but other variables say this process was started by {launcher}",
        "launch with an unmodified launcher, or set RANK, WORLD_SIZE, LOCAL_RANK and "
        "LOCAL_WORLD_SIZE yourself",
    )
