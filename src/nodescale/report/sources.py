"""What a directory given to ``nodescale report`` is, and its content.

Four kinds are recognised, by the files they hold:

- a sweep: ``sweep.json`` (``nodescale launch --sweep``), its members' runs in its ``mNNN`` folders;
- a training run: ``summary.json`` and ``metrics.jsonl`` (``nodescale train``), with
  ``monitor/node-N.csv`` when it ran with ``--monitor``;
- a bench scaling directory: ``scaling.json`` (``nodescale bench scaling``);
- a bench comm directory: ``results.json`` whose rows have ``op`` and
  ``busbw_GBps`` (``nodescale bench comm``).

Anything else is a ``UserError`` naming what was expected.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodescale.bench import scaling_study
from nodescale.errors import UserError
from nodescale.launch import sweep_manifest, sweep_state
from nodescale.launch.sweep_manifest import Sweep

EXPECTED = ("a training run (summary.json and metrics.jsonl), a sweep (sweep.json), a `nodescale bench scaling` "
            "directory (scaling.json) or a `nodescale bench comm` directory (results.json)")

# Fields of bench comm rows that describe the whole run when every row has the same value.
SHARED_COMM_FIELDS = ("backend", "device", "world_size", "iterations", "warmup")


@dataclass
class RunSource:
    """A training run: its summary and its metric records."""

    path: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    skipped_lines: int = 0  # metrics.jsonl lines that were not JSON (a run cut off mid-write)
    label: str = ""
    monitor_files: list[Path] = field(default_factory=list)  # monitor/node-N.csv of a --monitor run
    kind: str = field(default="run", init=False)

    def records(self, kind: str) -> list[dict[str, Any]]:
        """The metric records of one kind (``step``, ``epoch``, ``checkpoint``)."""
        return [record for record in self.metrics if record.get("kind") == kind]


@dataclass
class ScalingSource:
    """A ``nodescale bench scaling`` directory: the content of its ``scaling.json``."""

    path: Path
    result: dict[str, Any]
    label: str = ""
    kind: str = field(default="scaling", init=False)


@dataclass
class CommSource:
    """A ``nodescale bench comm`` directory: the rows of ``results.json`` and its other top-level fields."""

    path: Path
    rows: list[dict[str, Any]]  # [] for a directory of `--pairs` only
    meta: dict[str, Any]
    label: str = ""
    kind: str = field(default="comm", init=False)
    pairs: dict[str, Any] | None = None  # pairs.json of `bench comm --pairs`, when the directory has one


@dataclass
class SweepSource:
    """A sweep (``nodescale launch --sweep``): its record, each member's state and each finished member's summary."""

    path: Path
    sweep: Sweep
    states: dict[int, str]  # member index -> done, failed, running, pending... (launch/sweep_state.py)
    summaries: dict[int, dict[str, Any]]  # member index -> its summary.json, for the members that wrote one
    label: str = ""
    kind: str = field(default="sweep", init=False)


Source = RunSource | ScalingSource | CommSource | SweepSource


def load_source(path: Path) -> Source:
    """Recognise and read the directory ``path``; a ``UserError`` if it is none of the known kinds."""
    if not path.is_dir():
        raise UserError(f"{str(path)!r}", "is not a directory", f"pass {EXPECTED}")
    if sweep_manifest.is_sweep(path):
        return _sweep(path)
    if scaling_study.is_study(path):  # the sizes finished so far, collected again
        return ScalingSource(path, scaling_study.collect_study(path))
    if (path / "scaling.json").is_file():
        result = _read_json(path / "scaling.json")
        if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
            raise UserError(f"{path / 'scaling.json'}", "has no `rows` list", "re-run nodescale bench scaling")
        return ScalingSource(path, result)
    pairs = _comm_pairs(path / "pairs.json")
    if (path / "results.json").is_file():
        rows, meta = _comm_rows(path / "results.json")
        if rows is not None:
            return CommSource(path, rows, meta, pairs=pairs)
    if pairs is not None:
        return CommSource(path, [], {}, pairs=pairs)
    if (path / "summary.json").is_file() and (path / "metrics.jsonl").is_file():
        summary = _read_json(path / "summary.json")
        if not isinstance(summary, dict) or "world_size" not in summary:
            raise UserError(f"{path / 'summary.json'}", "is not a nodescale run summary (no world_size)",
                            f"pass {EXPECTED}")
        metrics, skipped = _read_jsonl(path / "metrics.jsonl")
        return RunSource(path, summary, metrics, skipped, monitor_files=_monitor_files(path))
    present = sorted(child.name for child in path.iterdir())[:8]
    return _unknown(path, present)


def _sweep(path: Path) -> SweepSource:
    sweep = _moved_to(sweep_manifest.read(path), path)
    states = sweep_state.member_states(sweep, sweep_state.query_queue([sweep]))
    summaries = {}
    for member in sweep.members:
        try:
            summary = json.loads((Path(member.run_dir) / "summary.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):  # not finished (or lost): shown by its state
            continue
        if isinstance(summary, dict):
            summaries[member.index] = summary
    return SweepSource(path, sweep, states, summaries)


def _moved_to(sweep: Sweep, path: Path) -> Sweep:
    """``sweep`` read from ``path`` after it was moved or copied (off the cluster, say): its files are read
    under ``path``, not where sweep.json's absolute paths point."""
    if path.resolve() == sweep.directory.resolve():
        return sweep
    members = []
    for member in sweep.members:
        run_dir = Path(member.run_dir)
        if run_dir.is_relative_to(sweep.directory):
            run_dir = path / run_dir.relative_to(sweep.directory)
        members.append(dataclasses.replace(member, run_dir=str(run_dir)))
    return dataclasses.replace(sweep, directory=path, members=members)


def _unknown(path: Path, present: list[str]) -> Source:
    found = ", ".join(present) if present else "nothing"
    hint = f"pass {EXPECTED}"
    if "summary.json" in present or "metrics.jsonl" in present:
        hint = "a training run needs both summary.json and metrics.jsonl: did the run finish?"
    raise UserError(f"{str(path)!r}", f"is not a run or benchmark directory (it holds {found})", hint)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}", f"cannot be read as JSON ({exc})", "is the file complete?") from None


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    records, skipped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a last line cut off by a crash must not hide the rest
            skipped += 1
            continue
        if isinstance(record, dict):
            records.append(record)
    return records, skipped


def _monitor_files(path: Path) -> list[Path]:
    """``monitor/node-N.csv`` in node order (node-10 after node-9)."""
    files = [child for child in (path / "monitor").glob("node-*.csv") if child.is_file()]
    return sorted(files, key=lambda child: (len(child.stem), child.stem))


def _comm_pairs(path: Path) -> dict[str, Any] | None:
    """``bench comm --pairs``' report, or None when there is none; a file of another shape is an error."""
    if not path.is_file():
        return None
    data = _read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("pairs"), list):
        raise UserError(f"{path}", "is not a `nodescale bench comm --pairs` report (no `pairs` list)",
                        "re-run nodescale bench comm --pairs")
    return data


def _comm_rows(path: Path) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """The measurement rows of a bench comm ``results.json`` (a list, or a mapping holding one), or None."""
    data = _read_json(path)
    meta: dict[str, Any] = {}
    rows: Any = data
    if isinstance(data, dict):
        meta = {key: value for key, value in data.items() if not isinstance(value, (list, dict))}
        lists = [value for key, value in data.items() if key in ("results", "rows", "measurements")]
        rows = lists[0] if lists else None
    if not isinstance(rows, list) or not rows:
        return None, meta
    if not all(isinstance(row, dict) and "op" in row and "busbw_GBps" in row for row in rows):
        return None, meta
    for key in SHARED_COMM_FIELDS:  # settings every row repeats are shown once
        values = {json.dumps(row.get(key)) for row in rows}
        if key not in meta and len(values) == 1 and rows[0].get(key) is not None:
            meta[key] = rows[0][key]
    return rows, meta
