"""A scaling study across node counts: one cluster job per count, recorded in ``STUDY/study.json``.

``nodescale bench scaling --nodes 1,2,4 --cluster C`` submits the jobs (see
:mod:`nodescale.cli.bench_scaling_study`); each runs ``nodescale train`` into ``STUDY/nodes-N``.
:func:`collect_study` reads the jobs' states (the scheduler's queue, then the run directories:
there may be no ``sacct``) and tabulates whatever sizes have finished with today's
:func:`~nodescale.bench.scaling_results.collect`; a size that failed or has not finished is listed
as such, never as a zero.
"""

from __future__ import annotations

import fcntl
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nodescale.atomic_files import write_json_atomic
from nodescale.bench.scaling_results import NODES_PREFIX, collect, read_summary, write_outputs
from nodescale.errors import UserError

STUDY_FILE = "study.json"
LOCK_FILE = ".collect.lock"
DONE = "done"


def parse_nodes(text: str) -> list[int]:
    """``--nodes 1,2,4`` as node counts in increasing order; 0, duplicates and non-numbers are refused."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        raise UserError(f"--nodes {text}", "must be node counts separated by commas", "e.g. --nodes 1,2,4")
    counts = [int(item) for item in items]
    if min(counts) < 1:
        raise UserError(f"--nodes {text}", "a job needs at least 1 node", "e.g. --nodes 1,2,4")
    repeated = sorted({n for n in counts if counts.count(n) > 1})
    if repeated:
        raise UserError(f"--nodes {text}", f"names {', '.join(map(str, repeated))} twice",
                        "give each node count once, e.g. --nodes 1,2,4")
    return sorted(counts)


@dataclass
class StudyJob:
    nodes: int
    world_size: int  # nodes x processes per node
    run_dir: str  # absolute; nodescale train writes its summary.json here
    job_id: str | None = None  # None until submitted
    script: str | None = None
    log: str | None = None


@dataclass
class Study:
    directory: Path
    scheduler: str
    mode: str
    batch_size: int  # strong: the global batch; weak: each process's
    max_steps: int
    warmup_steps: int
    nproc_per_node: int
    sequential: bool
    train_args: list[str]  # passed to every run
    launch_argv: list[str]  # the launch flags every job was built from (without --nodes and the command)
    jobs: list[StudyJob] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "directory": str(self.directory)}


def run_dir(directory: Path, nodes: int) -> Path:
    return directory / f"{NODES_PREFIX}{nodes}"


def write(study: Study) -> Path:
    """Create or replace ``study.json`` (atomically: ``report`` may read it while jobs are submitted)."""
    path = study.directory / STUDY_FILE
    write_json_atomic(path, study.to_json())
    return path


def is_study(directory: Path) -> bool:
    return (directory / STUDY_FILE).is_file()


def read(directory: Path) -> Study:
    path = directory / STUDY_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        jobs = [StudyJob(**job) for job in data.pop("jobs")]
        return Study(**{**data, "directory": Path(data["directory"]), "jobs": jobs})
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{path}", f"cannot be read as a scaling study ({exc})",
                        "it is written by nodescale bench scaling --nodes; do not edit it") from None


def job_states(study: Study) -> dict[int, str]:
    """Node count -> ``done`` (its summary.json exists), the scheduler's state while it is queued or
    running, ``failed (STATE)`` once it ended without a summary, or ``not submitted``."""
    from nodescale.launch.schedulers.batch import ENDED
    from nodescale.launch.schedulers.table import BATCH

    ids = [job.job_id for job in study.jobs if job.job_id]
    listed = BATCH[study.scheduler].status(ids) if ids and study.scheduler in BATCH else {}
    states = {}
    for job in study.jobs:
        state = listed.get(job.job_id or "")
        if (Path(job.run_dir) / "summary.json").is_file():
            states[job.nodes] = DONE
        elif job.job_id is None:
            states[job.nodes] = "not submitted"
        elif state is not None and state not in ENDED:
            states[job.nodes] = state.lower()
        else:  # ended, or no longer listed, without a summary
            states[job.nodes] = f"failed ({state})" if state and state not in ("COMPLETED", "FINISHED") else "failed"
    return states


def collect_study(directory: Path, peak_choice: str = "auto", mode: Any = None) -> dict[str, Any]:
    """The study's result (``scaling.json``'s content, rows for the finished sizes only, each with its
    ``nodes``), with ``study``: each node count's job and state. Written to STUDY when a size has finished.

    Jobs that end together each collect (``launch/after_step.py``): one at a time, under a lock on
    ``STUDY/.collect.lock``, so the last to write has read every size finished before it began."""
    try:
        lock = open(directory / LOCK_FILE, "a", encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError:  # a study one may read but not write
        return _collect_locked(directory, peak_choice, mode)
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a file system without flock: the writes stay atomic, the last may miss a size
            pass
        return _collect_locked(directory, peak_choice, mode)


def _collect_locked(directory: Path, peak_choice: str, mode: Any) -> dict[str, Any]:
    study = read(directory)
    states = job_states(study)
    done = {job.nodes: job for job in study.jobs if states[job.nodes] == DONE}
    sizes = {nodes: int(read_summary(Path(job.run_dir))["world_size"]) for nodes, job in done.items()}
    if sizes:
        result = collect(directory, mode or study.mode, peak_choice, None, sorted(sizes.values()))
    else:
        result = {"benchmark": "scaling", "mode": study.mode, "settings": {}, "device": None, "rows": [],
                  "notes": [], "peak": None}
    nodes_of = {world: nodes for nodes, world in sizes.items()}
    for row in result["rows"]:
        row["nodes"] = nodes_of[row["world_size"]]
    missing = [f"{job.nodes} node(s): {states[job.nodes]}" for job in study.jobs if job.nodes not in done]
    if missing:
        result["notes"].insert(0, f"not in the table (no result yet): {'; '.join(missing)}")
    result["study"] = {"scheduler": study.scheduler, "sequential": study.sequential, "jobs": [
        {"nodes": job.nodes, "world_size": job.world_size, "job_id": job.job_id, "state": states[job.nodes],
         "run_dir": job.run_dir} for job in study.jobs]}
    if sizes:
        write_outputs(directory, result)
    return result
