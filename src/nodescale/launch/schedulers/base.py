"""What a scheduler is: a dry run of a job, then the one call that submits (or runs) that dry run.

As in torchx's scheduler interface, ``submit(dryrun(spec, preset))`` is the whole launch: the dry
run does everything but submit (checks, rendering, the command line) and holds exactly what
would be written and executed, so ``--dry-run`` prints what a real launch does.
Queueing schedulers (Slurm, PBS) also cancel, report and locate the logs of their jobs
(:mod:`nodescale.launch.schedulers.batch`).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from nodescale.errors import UserError
from nodescale.launch.spec import JobSpec, Preset


@dataclass(frozen=True)
class DryRun:
    """What a launch of ``spec`` would write and execute, with nothing done yet."""

    spec: JobSpec
    argv: tuple[str, ...]  # executed: the job itself (local), or the submit command (its last word the script's path)
    env: Mapping[str, str] = field(default_factory=dict)  # set for ``argv`` over this process's environment
    script: str | None = None  # the job script, written to ``argv[-1]`` before ``argv`` runs

    def show(self) -> str:
        """The dry run as ``--dry-run`` prints it: the command line, then the script if there is one."""
        if self.script is None:
            return " ".join([*(f"{name}={shlex.quote(value)}" for name, value in self.env.items()),
                             shlex.join(self.argv)]) + "\n"
        return f"# {' '.join(self.argv)}\n{self.script}"


class Scheduler(ABC):
    """One way to run a job: on this machine, or through a cluster's scheduler."""

    name: ClassVar[str]

    @abstractmethod
    def dryrun(self, spec: JobSpec, preset: Preset | None) -> DryRun:
        """Check the job and build everything a launch writes and executes; UserError for a job that cannot run."""

    @abstractmethod
    def submit(self, dryrun: DryRun) -> int:
        """Do what ``dryrun`` holds; return the exit code of ``nodescale launch``."""


def run_scheduler_command(argv: Sequence[str], what: str) -> str:
    """Run a scheduler command and return its stdout; a missing command or a refusal is a UserError."""
    if shutil.which(argv[0]) is None:
        raise UserError(f"{argv[0]}", "is not on PATH here",
                        f"run this on the cluster's login node, or use --dry-run to print the {what}")
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        raise UserError(f"{' '.join(argv)}", f"the scheduler refused: {said}",
                        "check the account, queue and limits in the printed script (--dry-run)")
    return result.stdout
