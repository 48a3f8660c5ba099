"""PBS Pro: qsub, qdel, qstat, and the log file PBS names after the job."""

from __future__ import annotations

from collections.abc import Sequence

from nodescale.launch.partition_fit import Partition, Unreachable
from nodescale.launch.render_pbs import MAX_JOB_NAME, render_pbs
from nodescale.launch.schedulers import pbs_nodes
from nodescale.launch.schedulers.batch import BatchScheduler, query
from nodescale.launch.shell import safe_job_name
from nodescale.launch.spec import JobSpec, Preset

# qstat's one-letter states, in the words Slurm uses (``nodescale jobs`` shows both).
STATES = {"Q": "PENDING", "R": "RUNNING", "F": "FINISHED", "E": "EXITING", "H": "HELD", "X": "FINISHED"}


class Pbs(BatchScheduler):
    """PBS Pro: ``qsub SCRIPT`` prints the job id (``NUMBER.SERVER``)."""

    name = "pbs"
    submit_command = ("qsub",)
    cancel_command = ("qdel",)
    default_preset = "generic-pbs"

    def render(self, spec: JobSpec, preset: Preset) -> str:
        return render_pbs(spec, preset)

    def status(self, job_ids: Sequence[str]) -> dict[str, str]:
        if not job_ids:
            return {}
        out = query(["qstat", "-x", *job_ids])
        # qstat may shorten "3456789.desched1" to "3456789.desc*": match ids by their number.
        by_number = {job_id.split(".")[0]: job_id for job_id in job_ids}
        states = {}
        for parts in (line.split() for line in out.splitlines()):
            if len(parts) >= 5 and parts[0].split(".")[0] in by_number:
                states[by_number[parts[0].split(".")[0]]] = STATES.get(parts[4], parts[4])
        return states

    def read_partition(self, spec: JobSpec, preset: Preset) -> Partition | Unreachable:
        return pbs_nodes.read_queue(spec.queue or preset.queue)

    def log_path(self, spec: JobSpec, job_id: str) -> str:
        # PBS names the file after the job's (sanitised) -N name and the number of its id.
        return str(spec.job_dir / f"{safe_job_name(spec.job_name, limit=MAX_JOB_NAME)}.o{job_id.split('.')[0]}")
