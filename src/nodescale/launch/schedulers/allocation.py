"""Inside an allocation the user already holds (``salloc``, ``qsub -I``): a step there, no new job.

The rule, Slurm: ``SLURM_JOB_ID`` is set in a ``salloc`` shell, but also in a batch script and
in every task of a step. So this is an allocation when SLURM_JOB_ID is set, no ordinary step is
running this shell (``SLURM_STEP_ID`` unset, or Slurm's interactive step 0xfffffffa), and Slurm
says the job is not a batch job (``scontrol show job``: BatchFlag=0). Where scontrol cannot say,
a shell outside every step (no ``SLURM_PROCID``: a batch script has it) is taken for salloc's.
PBS: ``PBS_ENVIRONMENT=PBS_INTERACTIVE`` (a batch job has PBS_BATCH).

The step is the job script the scheduler would have queued, rendered the same way and run here
with bash: its ``srun`` (or ``mpiexec``) lines start the processes in the allocation. There is
no requeue inside an interactive allocation: the script has no signal trap and no requeue.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from nodescale.distributed.hostlist import expand_hostlist, read_nodefile
from nodescale.errors import UserError
from nodescale.launch.checks import check_job
from nodescale.launch.job_files import make_job_dir
from nodescale.launch.partition_fit import Node, Partition, fit_job
from nodescale.launch.schedulers.base import DryRun, Scheduler
from nodescale.launch.schedulers.batch import BatchScheduler, new_script_file
from nodescale.launch.schedulers.client import client_output
from nodescale.launch.shell import safe_job_name
from nodescale.launch.spec import JobSpec, Preset

SLURM_INTERACTIVE_STEP = str(0xFFFFFFFA)  # salloc's shell under LaunchParameters=use_interactive_step
_CPUS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def slurm_allocation(env: Mapping[str, str], batch_flag: str | None) -> bool:
    """Whether this shell holds an interactive Slurm allocation (the module's rule); ``batch_flag``: Slurm's
    BatchFlag of ``SLURM_JOB_ID``, None where scontrol could not say."""
    if not env.get("SLURM_JOB_ID") or env.get("SLURM_STEP_ID", SLURM_INTERACTIVE_STEP) != SLURM_INTERACTIVE_STEP:
        return False
    if batch_flag is not None:
        return batch_flag == "0"
    return not env.get("SLURM_PROCID")


def pbs_allocation(env: Mapping[str, str]) -> bool:
    """Whether this shell is an interactive PBS job's (``qsub -I``)."""
    return env.get("PBS_ENVIRONMENT") == "PBS_INTERACTIVE" and bool(env.get("PBS_JOBID"))


def cpus_per_node(text: str) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE`` (``2(x3),1``) as one count per node."""
    counts: list[int] = []
    for entry in filter(None, text.split(",")):
        match = _CPUS.match(entry.strip())
        if match:
            counts += [int(match[1])] * int(match[2] or 1)
    return counts


def step_scheduler(batch: BatchScheduler, env: Mapping[str, str] | None = None) -> AllocationStep | None:
    """The scheduler that starts the job as a step of the allocation this shell holds; None outside one."""
    env = os.environ if env is None else env
    if batch.name == "slurm" and env.get("SLURM_JOB_ID"):
        shown = client_output("scontrol", "show", "job", "-o", env["SLURM_JOB_ID"])
        flag = re.search(r"(?:^|\s)BatchFlag=(\d)", shown) if isinstance(shown, str) else None
        if slurm_allocation(env, flag[1] if flag else None):
            return AllocationStep(batch, env["SLURM_JOB_ID"], dict(env))
    if batch.name == "pbs" and pbs_allocation(env):
        return AllocationStep(batch, env["PBS_JOBID"], dict(env))
    return None


def salloc_nodes(env: Mapping[str, str], preset: Preset) -> tuple[Node, ...]:
    """The allocation's nodes, CPUs and GPUs as salloc's variables give them."""
    names = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    cpus = cpus_per_node(env.get("SLURM_JOB_CPUS_PER_NODE", ""))
    gpus = int(env["SLURM_GPUS_ON_NODE"]) if env.get("SLURM_GPUS_ON_NODE", "").isdigit() else 0
    return tuple(Node(name, cpus[i] if i < len(cpus) else 1, gpus, None) for i, name in enumerate(names))


def pbs_interactive_nodes(env: Mapping[str, str], preset: Preset) -> tuple[Node, ...]:
    """The interactive job's nodes (PBS_NODEFILE), its CPUs per node (NCPUS); PBS names no GPU count."""
    hosts = read_nodefile(env["PBS_NODEFILE"]) if env.get("PBS_NODEFILE") else []
    cpus = int(env["NCPUS"]) if env.get("NCPUS", "").isdigit() else preset.cpus_per_node
    return tuple(Node(host, cpus, preset.gpus_per_node, None) for host in dict.fromkeys(hosts))


class AllocationStep(Scheduler):
    """The batch scheduler's job script, without requeue, run with bash in the allocation this shell holds."""

    def __init__(self, batch: BatchScheduler, job_id: str, env: dict[str, str]) -> None:
        self.batch, self.job_id, self.env = batch, job_id, env
        self.name = batch.name  # type: ignore[misc]

    def dryrun(self, spec: JobSpec, preset: Preset | None) -> DryRun:
        if preset is None:
            raise ValueError(f"a {self.name} step needs a cluster preset")
        spec = spec.model_copy(update={"stop_handler": "none"})  # no requeue inside an interactive allocation
        nodes = (salloc_nodes if self.name == "slurm" else pbs_interactive_nodes)(self.env, preset)
        # What the allocation holds is the job's, whatever the preset guessed.
        preset = preset.model_copy(update={"cpus_per_node": min((node.cpus for node in nodes), default=1),
                                           "gpus_per_node": min((node.gpus for node in nodes), default=0)})
        preset = fit_job(spec, preset, Partition(self.job_id, nodes, kind="allocation"))
        check_job(spec, preset)
        stem = f"{safe_job_name(spec.job_name)}-step-{time.strftime('%Y%m%d-%H%M%S')}"
        return DryRun(spec, ("bash", str(spec.job_dir / f"{stem}.sh")), script=self.batch.render(spec, preset))

    def script_file(self, dryrun: DryRun) -> Path:
        """The step's script, written to a file of its own in the job directory."""
        assert dryrun.script is not None, "a step's dry run holds its script"
        make_job_dir(dryrun.spec.job_dir)
        return new_script_file(dryrun.spec.job_dir, Path(dryrun.argv[-1]).stem, dryrun.script)

    def submit(self, dryrun: DryRun) -> int:
        """Write the script and run it here: its launch lines start the step; the exit code is the step's."""
        path = self.script_file(dryrun)
        print(f"nodescale: in {self.name} allocation {self.job_id}: starting the job as a step there "
              f"(no new job, no requeue); script {path}", file=sys.stderr, flush=True)
        try:
            return subprocess.run(["bash", str(path)], check=False).returncode
        except KeyboardInterrupt:
            raise UserError(f"the step in allocation {self.job_id}", "was interrupted") from None
