"""A sweep's members submitted as array jobs, or run here one after another, and their states.

The array job's command is the member wrapper (:mod:`nodescale.launch.sweep_member`) around the
user's command; the script names the member (:mod:`nodescale.launch.job_array`). Each submission
is appended to ``sweep.json`` and logged for ``nodescale jobs`` with the sweep's directory.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nodescale.atomic_files import write_text_atomic
from nodescale.launch import job_array, sweep_manifest
from nodescale.launch.schedulers import pbs_version
from nodescale.launch.schedulers.base import DryRun
from nodescale.launch.schedulers.batch import BatchScheduler
from nodescale.launch.spec import JobArray, JobSpec, Preset
from nodescale.launch.sweep import member_command
from nodescale.launch.sweep_manifest import Submission, Sweep

if TYPE_CHECKING:
    from nodescale.launch.schedulers.allocation import AllocationStep

WRAPPER = ("nodescale", "sweep-member")  # nodescale.cli.main.SWEEP_MEMBER


def dryruns(scheduler: BatchScheduler, spec: JobSpec, preset: Preset, sweep: Sweep, command: Sequence[str],
            indices: Sequence[int], max_concurrent: int | None) -> list[DryRun]:
    """One array job of ``indices`` (PBS: one per range ``-J`` can say), each member running ``command``."""
    if scheduler.name == "pbs":
        pbs_version.check_max_concurrent(max_concurrent)
    groups = job_array.pbs_runs(indices) if scheduler.name == "pbs" else [list(indices)]
    wrapped = [*WRAPPER, str(sweep.directory), "--", *command]
    return [scheduler.dryrun(spec.model_copy(update={
        "command": wrapped, "array": JobArray(indices=group, max_concurrent=max_concurrent,
                                              sweep_dir=sweep.directory)}), preset) for group in groups]


def submit(scheduler: BatchScheduler, sweep: Sweep, jobs: Sequence[DryRun], resume: bool) -> None:
    """Queue each job, log it with the sweep's directory, and record it in ``sweep.json``."""
    for dryrun in jobs:
        spec = dryrun.spec
        assert spec.array is not None, "a sweep's job is an array job"
        job = scheduler.queue(dryrun)
        sweep.submissions.append(Submission(job.job_id, scheduler.name, list(spec.array.indices), resume, job.log,
                                            time.time()))
        sweep_manifest.write(sweep)
        shown = job_array.ranges(spec.array.indices)
        print(f"submitted {scheduler.name} job {job.job_id}: sweep members {shown}")
        print(f"  script: {job.script}")
        print(f"  logs:   {job.log}")


def run_here(sweep: Sweep, spec: JobSpec, command: Sequence[str], indices: Sequence[int], resume: bool,
             max_concurrent: int | None, step: AllocationStep | None = None, preset: Preset | None = None) -> int:
    """Run the members from here, ``max_concurrent`` at once (default one after another): on this machine, or
    each as a ``step`` of the allocation this shell holds (salloc, qsub -I). A failed member does not stop the
    others. Each member's output goes to its log, its exit code to its status file."""
    log = str(sweep.directory / "logs" / "{index}.log")
    sweep.submissions.append(Submission("local", "local", list(indices), resume, log, time.time()))
    sweep_manifest.write(sweep)
    (sweep.directory / "logs").mkdir(parents=True, exist_ok=True)
    members = {member.index: member for member in sweep.members}
    waiting, running, failed = list(indices), {}, []
    try:
        while waiting or running:
            while waiting and len(running) < (max_concurrent or 1):
                index = waiting.pop(0)
                argv, env = member_command(sweep, members[index], command, resume)
                argv, env = _started_by(spec.model_copy(update={"command": argv, "env": {**spec.env, **env}}),
                                        step, preset)
                with open(log.format(index=index), "ab") as out:
                    running[index] = subprocess.Popen(argv, env={**os.environ, **env}, cwd=spec.workdir, stdout=out,
                                                      stderr=subprocess.STDOUT)
            time.sleep(0.05)
            for index, process in list(running.items()):
                if process.poll() is None:
                    continue
                del running[index]
                write_text_atomic(sweep_manifest.status_path(sweep.directory, index), f"{process.returncode}\n")
                settings = " ".join(f"{key}={value}" for key, value in members[index].settings.items())
                print(f"member {index} ({settings}): exit code {process.returncode}, log {log.format(index=index)}",
                      flush=True)
                if process.returncode != 0:
                    failed.append(index)
    finally:
        for process in running.values():  # interrupted: the members still running end with this launch
            process.terminate()
            process.wait()
    print(f"sweep {sweep.directory}: {len(indices)} members run, {len(failed)} failed"
          + (f" ({', '.join(map(str, sorted(failed)))}: `nodescale launch --resubmit-failed "
             f"{sweep.directory}` runs them again)" if failed else ""))
    return 1 if failed else 0


def _started_by(spec: JobSpec, step: AllocationStep | None, preset: Preset | None) -> tuple[list[str], dict[str, str]]:
    """What starts one member: the local launcher, or the allocation's step script (written here)."""
    if step is None:
        from nodescale.launch.schedulers.local import Local

        dryrun = Local().dryrun(spec, None)
        return list(dryrun.argv), dict(dryrun.env)
    return ["bash", str(step.script_file(step.dryrun(spec, preset)))], {}


def failed_members(sweep: Sweep) -> tuple[list[int], dict[str, int]]:
    """The failed members' indices, and how many members are in each state (as ``nodescale jobs`` counts them)."""
    from nodescale.launch import sweep_state

    states = sweep_state.member_states(sweep, sweep_state.query_queue([sweep]))
    counts: dict[str, int] = {}
    for state in states.values():
        counts[state] = counts.get(state, 0) + 1
    return [index for index, state in states.items() if state == "failed"], counts


def forget_status(sweep: Sweep, indices: Sequence[int]) -> None:
    """Remove the old exit codes of members about to run again (until they end, they are queued, not failed)."""
    for index in indices:
        Path(sweep_manifest.status_path(sweep.directory, index)).unlink(missing_ok=True)


def print_table(sweep: Sweep, indices: Sequence[int]) -> None:
    """The members as ``--dry-run`` shows them: index, each setting, run directory."""
    header = ["index", *sweep.keys, "run dir"]
    rows = [[str(m.index), *(str(m.settings[key]) for key in sweep.keys), m.run_dir]
            for m in sweep.members if m.index in set(indices)]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
