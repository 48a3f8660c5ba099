"""PBS Pro: qsub, qdel, qstat, and the log file PBS names after the job."""

from __future__ import annotations

import re
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
        # -t: an array job's subjobs too, each on its own line.
        return parse_qstat(query(["qstat", "-x", "-t", *job_ids]), job_ids)

    def member_id(self, array_id: str, index: int) -> str:
        return subjob_id(array_id, index)

    def read_partition(self, spec: JobSpec, preset: Preset) -> Partition | Unreachable:
        return pbs_nodes.read_queue(spec.queue or preset.queue)

    def log_path(self, spec: JobSpec, job_id: str) -> str:
        number = job_id.split(".")[0].split("[")[0]
        if spec.array is not None:  # the script's -o; one member is a plain job (-J needs two)
            single = len(spec.array.indices) == 1
            return str(spec.job_dir / (f"pbs-{number}.log" if single else f"pbs-{number}[{{index}}].log"))
        # PBS names the file after the job's (sanitised) -N name and the number of its id.
        return str(spec.job_dir / f"{safe_job_name(spec.job_name, limit=MAX_JOB_NAME)}.o{number}")


def parse_qstat(out: str, job_ids: Sequence[str]) -> dict[str, str]:
    """``qstat -x -t``'s lines as the state of each of ``job_ids`` and of each subjob of an array among them
    (``123[4].server`` of ``123[].server``), under the ids as nodescale stored them."""
    # qstat may shorten "3456789.desched1" to "3456789.desc*": match ids by their number.
    by_number = {job_id.split(".")[0]: job_id for job_id in job_ids}
    states = {}
    for parts in (line.split() for line in out.splitlines()):
        if len(parts) < 5:
            continue
        number = parts[0].split(".")[0]
        subjob = re.fullmatch(r"(\d+)\[(\d+)\]", number)  # 123[4] of the array 123[]
        if subjob and f"{subjob.group(1)}[]" in by_number:
            states[subjob_id(by_number[f"{subjob.group(1)}[]"], int(subjob.group(2)))] = STATES.get(parts[4], parts[4])
        elif number in by_number:
            states[by_number[number]] = STATES.get(parts[4], parts[4])
    return states


def subjob_id(array_id: str, index: int) -> str:
    """``123[].server``'s subjob ``index``: ``123[index].server``."""
    return array_id.replace("[]", f"[{index}]", 1)
