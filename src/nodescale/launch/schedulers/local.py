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
from nodescale.launch.schedulers.local_worker_group import one_worker_variables
from nodescale.launch.spec import JobSpec, Preset


class Local(Scheduler):
    """One process runs the command with torchrun's variables; several are started by :mod:`.local_launcher`."""

    name = "local"

    def dryrun(self, spec: JobSpec, preset: Preset | None) -> DryRun:
        """The command line that runs ``spec`` here, and the ``--env`` variables it is given."""
        if spec.nodes > 1:
            raise UserError(f"--nodes {spec.nodes} with --scheduler local", "a local run has one node",
                            "use --scheduler slurm or pbs (and --cluster) for several nodes")
        for warning in check_env(spec.env):
            warnings.warn(warning, stacklevel=2)
        if spec.spare_nodes:
            raise UserError(f"--spare-nodes {spec.spare_nodes} with --scheduler local", "a local run has one node",
                            "drop --spare-nodes; --max-restarts restarts the local processes")
        if spec.mode == "spawn" and spec.max_restarts:
            raise UserError(f"--max-restarts {spec.max_restarts} with --mode spawn and --scheduler local",
                            "the command starts its own processes here, so nodescale cannot restart them",
                            "use --mode torchrun, or restart inside the command")
        argv, env = list(spec.command), dict(spec.env)
        if spec.mode != "spawn" and (spec.nproc_per_node > 1 or spec.max_restarts):
            # One process with restarts runs as one restartable worker, as `nodescale train --max-restarts` does.
            argv = local_launcher.command_line(spec.nproc_per_node, spec.command, spec.max_restarts, spec.job_dir)
        elif spec.mode != "spawn":
            # One process is a torchrun job of one too (a CPU machine's default): any env:// script runs unchanged.
            env.update(one_worker_variables({**os.environ, **spec.env}))
        return DryRun(spec, tuple(argv), env)

    def submit(self, dryrun: DryRun) -> NoReturn:
        """Become the dry run's command (``exec``); UserError if its program is not on PATH."""
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvpe(dryrun.argv[0], dryrun.argv, {**os.environ, **dryrun.env})
        except FileNotFoundError:
            raise program_not_found(dryrun.argv[0]) from None
