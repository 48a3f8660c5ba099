"""The jobs nodescale submitted, so ``nodescale jobs`` and ``cancel`` know their scheduler.

One JSON line per job in ``$XDG_STATE_HOME/nodescale/jobs.jsonl`` (default
``~/.local/state/nodescale``), a place only the user writes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    scheduler: str
    name: str
    script: str
    log: str
    workdir: str
    submitted_at: float
    sweep: str = ""  # the sweep's directory when the job is a sweep's array (launch/sweep_manifest.py)


def registry_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "nodescale" / "jobs.jsonl"


def record(job: JobRecord) -> None:
    """Append ``job`` (one whole line: appends of a few hundred bytes are atomic)."""
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path, "a") as handle:
        handle.write(json.dumps(asdict(job)) + "\n")


def submitted_jobs() -> list[JobRecord]:
    """Every job in the registry, oldest first; unreadable lines are skipped."""
    path = registry_path()
    if not path.is_file():
        return []
    jobs = []
    for line in path.read_text().splitlines():
        try:
            jobs.append(JobRecord(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return jobs


def find(job_id: str) -> JobRecord | None:
    """The newest registry entry with this id."""
    matches = [job for job in submitted_jobs() if job.job_id == job_id]
    return matches[-1] if matches else None
