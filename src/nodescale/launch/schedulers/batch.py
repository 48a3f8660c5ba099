"""What Slurm and PBS share: a job script written to a file of its own, submitted, and logged.

Each scheduler's module says its commands (submit, cancel, status), how it renders the script
and where it writes the job's output; the steps around them are here, once.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time
import warnings
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from nodescale.errors import UserError
from nodescale.launch.checks import check_job
from nodescale.launch.job_files import create_script, make_job_dir
from nodescale.launch.job_log import JobRecord, record
from nodescale.launch.partition_fit import Partition, Unreachable, fit_job
from nodescale.launch.schedulers.base import DryRun, Scheduler, run_scheduler_command
from nodescale.launch.shell import safe_job_name
from nodescale.launch.spec import JobSpec, Preset

# Scheduler states (Slurm's words; PBS's are mapped to them) after which nothing of a job runs any more.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "FINISHED"}


class BatchScheduler(Scheduler):
    """A scheduler that queues a job script: ``dryrun`` renders it, ``submit`` queues it."""

    submit_command: ClassVar[tuple[str, ...]]  # the script's path follows
    cancel_command: ClassVar[tuple[str, ...]]  # the job id follows
    default_preset: ClassVar[str]  # the preset of ``--scheduler NAME`` without ``--cluster``

    @abstractmethod
    def render(self, spec: JobSpec, preset: Preset) -> str:
        """The job script (a pure function of the two)."""

    @abstractmethod
    def status(self, job_ids: Sequence[str]) -> dict[str, str]:
        """The scheduler's state of each job still known to it (finished jobs may be absent)."""

    @abstractmethod
    def member_id(self, array_id: str, index: int) -> str:
        """The id under which :meth:`status` lists member ``index`` of the array job ``array_id``."""

    @abstractmethod
    def read_partition(self, spec: JobSpec, preset: Preset) -> Partition | Unreachable:
        """The job's partition (queue) and its nodes as the scheduler reports them, or why it cannot be asked."""

    @abstractmethod
    def log_path(self, spec: JobSpec, job_id: str) -> str:
        """Where the scheduler writes the job's output, as the rendered script asks for it (an array's
        members: ``{index}`` where the member's index goes)."""

    def dryrun(self, spec: JobSpec, preset: Preset | None) -> DryRun:
        """The checked job's script, and the submit command with the path it is written to."""
        if preset is None:
            raise ValueError(f"a {self.name} job needs a cluster preset")
        preset = self.fit_to_cluster(spec, preset)
        check_job(spec, preset)
        script = self.render(spec, preset)
        stem = f"{safe_job_name(spec.job_name)}-{time.strftime('%Y%m%d-%H%M%S')}"
        return DryRun(spec, (*self.submit_command, str(spec.job_dir / f"{stem}.sh")), script=script)

    def fit_to_cluster(self, spec: JobSpec, preset: Preset) -> Preset:
        """``preset`` checked against the live nodes (a generic one sized to them); kept as it is, with a
        warning, where the scheduler cannot be asked (not on the cluster, say)."""
        found = self.read_partition(spec, preset)
        if isinstance(found, Unreachable):
            warnings.warn(f"{self.name}'s nodes not read ({found.reason}): the job keeps preset {preset.name}'s "
                          f"{preset.cpus_per_node} cores and {preset.gpus_per_node} GPUs per node, unchecked",
                          stacklevel=2)
            return preset
        return fit_job(spec, preset, found)

    def submit(self, dryrun: DryRun) -> int:
        """Queue the job (:meth:`queue`) and print it."""
        job = self.queue(dryrun)
        print(f"submitted {self.name} job {job.job_id}")
        print(f"  script: {job.script}")
        print(f"  log:    {job.log}")
        return 0

    def queue(self, dryrun: DryRun) -> JobRecord:
        """Write the script to a file of its own, submit it, and log the job (``nodescale jobs``): its record,
        whose ``log`` has ``{index}`` where an array member's index goes."""
        spec, path = dryrun.spec, Path(dryrun.argv[-1])
        assert dryrun.script is not None, "a batch dry run holds its script"
        make_job_dir(spec.job_dir)
        script_path = new_script_file(spec.job_dir, path.stem, dryrun.script)
        argv = [*dryrun.argv[:-1], str(script_path)]
        try:
            out = run_scheduler_command(argv, "job script").strip()
        except UserError:
            script_path.unlink(missing_ok=True)  # nothing was submitted: leave nothing that looks submitted
            raise
        # sbatch --parsable prints "ID" or "ID;CLUSTER"; qsub prints "ID.SERVER".
        job_id = out.splitlines()[-1].split(";")[0].strip() if out else ""
        if not re.match(r"^\d+", job_id):
            raise UserError(f"{argv[0]} output {out!r}", "holds no job id", "check the scheduler's logs")
        sweep = str(spec.array.sweep_dir) if spec.array is not None and spec.array.sweep_dir is not None else ""
        job = JobRecord(job_id, self.name, spec.job_name, str(script_path), self.log_path(spec, job_id),
                        str(spec.workdir), time.time(), sweep=sweep)
        record(dataclasses.replace(job, log=job.log.replace("{index}", "*")))  # `nodescale logs` globs members
        return job

    def cancel(self, job_id: str) -> None:
        """Ask the scheduler to end the job; UserError if it refuses."""
        run_scheduler_command([*self.cancel_command, job_id], "cancel command")


def query(argv: Sequence[str]) -> str:
    """A status command's output; empty where the command is not installed (no states known)."""
    if shutil.which(argv[0]) is None:
        return ""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60).stdout


def new_script_file(job_dir: Path, stem: str, script: str) -> Path:
    """A script file of its own: two launches in one second never share (or overwrite) one."""
    for attempt in range(1000):
        path = job_dir / (f"{stem}.sh" if attempt == 0 else f"{stem}-{attempt}.sh")
        try:
            fd = create_script(path)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(script)
        return path
    raise UserError(f"--job-dir {str(job_dir)!r}", f"already holds 1000 scripts named {stem}*",
                    "choose another --job-dir or --job-name")
