"""This machine: the command itself, or nodescale's local launcher for several processes.

The dry run holds the command line and the variables it gets, and the real run executes
exactly that (``exec``: the launch process becomes the job, so signals and the exit code are
the job's own). ``--dry-run`` prints it, and the printed line run in a shell does the same.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import NoReturn

from nodescale.errors import UserError, program_not_found
from nodescale.launch.envcheck import check_env
from nodescale.launch.schedulers import local_launcher
from nodescale.launch.schedulers.base import DryRun, Scheduler
from nodescale.launch.spec import JobSpec, Preset


class Local(Scheduler):
    """One process runs the command; several are started by :mod:`.local_launcher`, torchrun-style."""

    name = "local"

    def dryrun(self, spec: JobSpec, preset: Preset | None) -> DryRun:
        """The command line that runs ``spec`` here, and the ``--env`` variables it is given."""
        if spec.nodes > 1:
            raise UserError(f"--nodes {spec.nodes} with --scheduler local", "a local run has one node",
                            "use --scheduler slurm or pbs (and --cluster) for several nodes")
        for warning in check_env(spec.env):
            warnings.warn(warning, stacklevel=2)
        argv = list(spec.command)
        if spec.mode != "spawn" and spec.nproc_per_node > 1:
            argv = local_launcher.command_line(spec.nproc_per_node, spec.command)
        return DryRun(spec, tuple(argv), dict(spec.env))

    def submit(self, dryrun: DryRun) -> NoReturn:
        """Become the dry run's command (``exec``); UserError if its program is not on PATH."""
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvpe(dryrun.argv[0], dryrun.argv, {**os.environ, **dryrun.env})
        except FileNotFoundError:
            raise program_not_found(dryrun.argv[0]) from None
