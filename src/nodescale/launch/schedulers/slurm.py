"""Slurm: sbatch, scancel, squeue, and the log file the script asks for."""

from __future__ import annotations

import re
from collections.abc import Sequence

from nodescale.launch.partition_fit import Partition, Unreachable
from nodescale.launch.render_slurm import STDOUT_NAME, render_slurm
from nodescale.launch.schedulers import slurm_nodes
from nodescale.launch.schedulers.batch import BatchScheduler, query
from nodescale.launch.spec import JobSpec, Preset


class Slurm(BatchScheduler):
    """Slurm: ``sbatch --parsable SCRIPT`` prints the job id."""

    name = "slurm"
    submit_command = ("sbatch", "--parsable")
    cancel_command = ("scancel",)
    default_preset = "generic-slurm"

    def render(self, spec: JobSpec, preset: Preset) -> str:
        return render_slurm(spec, preset)

    def status(self, job_ids: Sequence[str]) -> dict[str, str]:
        if not job_ids:
            return {}
        # -t all: jobs that ended recently (COMPLETED, FAILED, CANCELLED) are still listed.
        return parse_squeue(query(["squeue", "-h", "-t", "all", "-o", "%i %T", "-j", ",".join(job_ids)]))

    def member_id(self, array_id: str, index: int) -> str:
        return f"{array_id}_{index}"

    def read_partition(self, spec: JobSpec, preset: Preset) -> Partition | Unreachable:
        gpu_type = preset.gpu_type if preset.gpu_request == "gres" else None
        return slurm_nodes.read_partition(spec.queue or preset.queue, gpu_type)

    def log_path(self, spec: JobSpec, job_id: str) -> str:
        number = job_id.split(".")[0]
        if spec.array is not None:
            return str(spec.job_dir / f"slurm-{number}_{{index}}.out")
        return str(spec.job_dir / STDOUT_NAME.replace("%j", number))


def parse_squeue(out: str) -> dict[str, str]:
    """``squeue -o "%i %T"`` lines as id -> state; an array's pending members listed as one group
    (``ID_[0-3,7%2]``, squeue without ``-r``) are given one entry each (``ID_0`` ... ``ID_7``)."""
    states = {}
    for parts in (line.split() for line in out.splitlines()):
        if len(parts) != 2:
            continue
        group = re.fullmatch(r"(\d+)_\[(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)(?:%\d+)?\]", parts[0])
        if group is None:
            states[parts[0]] = parts[1]
            continue
        for item in group.group(2).split(","):
            first, _, last = item.partition("-")
            for index in range(int(first), int(last or first) + 1):
                states[f"{group.group(1)}_{index}"] = parts[1]
    return states
