"""A sweep's members from ``--sweep`` flags, and the command each member runs (pure: no processes, no files).

``--sweep KEY=V1,V2`` is a grid key; grid keys cross with one another. ``--sweep KEY=log:LO:HI`` (or
``lin:LO:HI``, ``int:LO:HI``) is a range key: ``--trials N`` draws N points of every range key, seeded by
``--sweep-seed`` (the same flags give the same members), and the grid crosses with those N points.

A member of ``nodescale train`` runs the command with ``--set KEY=VALUE`` per setting and ``--out`` its
run directory (later flags win); any other command gets ``NODESCALE_SWEEP_<KEY>`` variables. Every
member also gets ``NODESCALE_SWEEP_INDEX``, ``NODESCALE_SWEEP_DIR`` and ``NODESCALE_RUN_DIR``.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescale.errors import UserError
from nodescale.launch.sweep_manifest import Member, Sweep

MAX_MEMBERS = 1000
RANGE_KINDS = ("log", "lin", "int")
# Light on purpose: nodescale.launch.sweep_member imports this module on every rank of every member.
INDEX_VARIABLE = "NODESCALE_SWEEP_INDEX"
RESUME_VARIABLE = "NODESCALE_SWEEP_RESUME"
_EXAMPLE = "e.g. --sweep optim.lr=0.1,0.01, or --sweep optim.lr=log:1e-4:1e-1 --trials 8"


@dataclass(frozen=True)
class Axis:
    """One ``--sweep`` flag: a grid key's values as given, or a range key's kind and bounds."""

    key: str
    values: tuple[str, ...] = ()
    kind: str | None = None  # log, lin or int: a range key
    low: float = 0.0
    high: float = 0.0

    def with_key(self, key: str) -> Axis:
        return Axis(key, self.values, self.kind, self.low, self.high)


def parse_axes(items: Sequence[str]) -> list[Axis]:
    """The ``--sweep`` flags as axes; UserError for an empty or malformed one, or a key given twice."""
    axes: list[Axis] = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not text.strip():
            raise UserError(f"--sweep {item!r}", "must look like KEY=V1,V2,... or KEY=log:LO:HI", _EXAMPLE)
        kind, _, bounds = text.partition(":")
        if kind in RANGE_KINDS and bounds:
            axes.append(_range_axis(item, key, kind, bounds))
            continue
        values = tuple(text.split(","))
        if any(not value.strip() for value in values):
            raise UserError(f"--sweep {item!r}", "has an empty value between commas", _EXAMPLE)
        axes.append(Axis(key, values))
    check_unique([axis.key for axis in axes])
    return axes


def _range_axis(item: str, key: str, kind: str, bounds: str) -> Axis:
    low_text, sep, high_text = bounds.partition(":")
    try:
        low, high = (int(low_text), int(high_text)) if kind == "int" else (float(low_text), float(high_text))
    except ValueError:
        number = "whole numbers" if kind == "int" else "numbers"
        raise UserError(f"--sweep {item!r}", f"needs two {number}: {kind}:LO:HI",
                        f"e.g. --sweep {key}={kind}:{'1:8' if kind == 'int' else '1e-4:1e-1'}") from None
    if not sep or not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise UserError(f"--sweep {item!r}", "needs finite bounds with LO below HI", f"e.g. --sweep {key}={kind}:1:8")
    if kind == "log" and low <= 0:
        raise UserError(f"--sweep {item!r}", "draws on a log scale, so LO must be above 0",
                        f"e.g. --sweep {key}=log:1e-4:1e-1, or lin:{low_text}:{high_text}")
    return Axis(key, kind=kind, low=low, high=high)


def check_unique(keys: Sequence[str], shown: Sequence[str] | None = None) -> None:
    """UserError for a key given twice (``shown``: the keys as the user typed them)."""
    shown = shown or keys
    for i, key in enumerate(keys):
        if key in keys[:i]:
            first = shown[keys.index(key)]
            same = "" if first == shown[i] else f" ({first} and {shown[i]} name the same setting)"
            raise UserError(f"--sweep {shown[i]}", f"is given twice{same}",
                            "give each key once, with all its values: --sweep KEY=V1,V2,V3")


def check_trials(axes: Sequence[Axis], trials: int | None) -> None:
    """Range keys and --trials come together."""
    drawn = [axis for axis in axes if axis.kind]
    if drawn and not trials:
        raise UserError(f"--sweep {drawn[0].key}={drawn[0].kind}:...", "is a range to draw from, and needs --trials N",
                        f"add --trials 8, or give the values: --sweep {drawn[0].key}=V1,V2")
    if trials and not drawn:
        raise UserError(f"--trials {trials}", "draws values of range keys, and no --sweep key is a range",
                        "e.g. --sweep optim.lr=log:1e-4:1e-1 --trials 8 (lin:LO:HI and int:LO:HI too)")


def member_count(axes: Sequence[Axis], trials: int | None) -> int:
    return math.prod(len(axis.values) for axis in axes if not axis.kind) * (trials or 1)


def check_size(axes: Sequence[Axis], trials: int | None, site_limit: int | None, preset: str) -> int:
    """The member count; UserError with the numbers above 1,000 or the preset's ``max_array_size``."""
    count = member_count(axes, trials)
    sizes = [f"{len(axis.values)} {axis.key}" for axis in axes if not axis.kind]
    shown = " x ".join([*sizes, *([f"{trials} trials"] if trials else [])]) + f" = {count} members"
    if count > MAX_MEMBERS:
        raise UserError(f"a sweep of {shown}", f"is over nodescale's limit of {MAX_MEMBERS} members",
                        "sweep fewer values, or split the sweep into several launches")
    if site_limit is not None and count > site_limit:
        raise UserError(f"a sweep of {shown}", f"is over cluster {preset}'s array limit of {site_limit}",
                        "sweep fewer values, or split the sweep into several launches")
    return count


def expand(axes: Sequence[Axis], trials: int | None, seed: int) -> list[dict[str, Any]]:
    """Every member's settings, in order: the grid's combinations (first key slowest), each with every trial."""
    rng = random.Random(seed)
    drawn = [axis for axis in axes if axis.kind]
    points = [{axis.key: _draw(axis, rng) for axis in drawn} for _ in range(trials or 1)]
    grid = [axis for axis in axes if not axis.kind]
    members = []
    for combination in itertools.product(*(axis.values for axis in grid)):
        for point in points:
            settings = {**dict(zip((axis.key for axis in grid), combination, strict=True)), **point}
            members.append({axis.key: settings[axis.key] for axis in axes})
    return members


def _draw(axis: Axis, rng: random.Random) -> int | float:
    if axis.kind == "int":
        return rng.randint(int(axis.low), int(axis.high))
    if axis.kind == "log":
        value = math.exp(rng.uniform(math.log(axis.low), math.log(axis.high)))
    else:
        value = rng.uniform(axis.low, axis.high)
    return float(f"{value:.4g}")  # four digits: readable in tables, and what the member runs


def env_name(key: str) -> str:
    """``optim.lr`` -> ``NODESCALE_SWEEP_OPTIM_LR``."""
    return "NODESCALE_SWEEP_" + re.sub(r"[^A-Za-z0-9]", "_", key.upper())


def run_dir(sweep_dir: Path, index: int) -> Path:
    return sweep_dir / f"m{index:03d}"


def is_train(command: Sequence[str]) -> bool:
    return list(command[:2]) == ["nodescale", "train"]


def yaml_value(value: Any) -> str:
    """``value`` as ``--set`` reads it back (YAML): ``1.0e-05``, ``'yes'`` (a string, not true)."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=math.inf).removesuffix("...\n").strip()


def member_command(sweep: Sweep, member: Member, command: Sequence[str],
                   resume: bool = False) -> tuple[list[str], dict[str, str]]:
    """The argv and the variables member ``member`` of ``sweep`` runs ``command`` with."""
    env = {INDEX_VARIABLE: str(member.index), "NODESCALE_SWEEP_DIR": str(sweep.directory),
           "NODESCALE_RUN_DIR": member.run_dir, **({RESUME_VARIABLE: "1"} if resume else {})}
    if not is_train(command):
        env.update({env_name(key): str(value)
                    for key, value in member.settings.items()})
        return list(command), env
    settings = [word for key, value in member.settings.items() for word in ("--set", f"{key}={yaml_value(value)}")]
    return [*command, *settings, "--out", member.run_dir, *(["--resume"] if resume else [])], env
