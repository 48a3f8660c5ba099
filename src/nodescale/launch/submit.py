"""The edge where rendered scripts meet the scheduler's commands (sbatch, qsub, ...).

Everything before this is pure; everything here runs a program and turns its
failures into user errors that say what the scheduler said.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence

from nodescale.errors import UserError

SUBMIT = {"slurm": ["sbatch", "--parsable"], "pbs": ["qsub"]}
PBS_STATES = {"Q": "PENDING", "R": "RUNNING", "F": "FINISHED", "E": "EXITING", "H": "HELD", "X": "FINISHED"}
CANCEL = {"slurm": ["scancel"], "pbs": ["qdel"]}


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


def submit_script(scheduler: str, script: str) -> str:
    """Submit the script file; return the job id the scheduler assigned."""
    out = run_scheduler_command([*SUBMIT[scheduler], script], "job script").strip()
    # sbatch --parsable prints "ID" or "ID;CLUSTER"; qsub prints "ID.SERVER".
    job_id = out.splitlines()[-1].split(";")[0].strip() if out else ""
    if not re.match(r"^\d+", job_id):
        raise UserError(f"{SUBMIT[scheduler][0]} output {out!r}", "holds no job id", "check the scheduler's logs")
    return job_id


def cancel_job(scheduler: str, job_id: str) -> None:
    run_scheduler_command([*CANCEL[scheduler], job_id], "cancel command")


def job_states(scheduler: str, job_ids: Sequence[str]) -> dict[str, str]:
    """The scheduler's state of each job still known to it (finished jobs may be absent)."""
    if not job_ids or shutil.which("squeue" if scheduler == "slurm" else "qstat") is None:
        return {}
    if scheduler == "slurm":
        # -t all: jobs that ended recently (COMPLETED, FAILED, CANCELLED) are still listed.
        argv = ["squeue", "-h", "-t", "all", "-o", "%i %T", "-j", ",".join(job_ids)]
    else:
        argv = ["qstat", "-x", *job_ids]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    # qstat may shorten "3456789.desched1" to "3456789.desc*": match ids by their number.
    by_number = {job_id.split(".")[0]: job_id for job_id in job_ids}
    states = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if scheduler == "slurm" and len(parts) == 2:
            states[parts[0]] = parts[1]
        elif scheduler == "pbs" and len(parts) >= 5 and parts[0].split(".")[0] in by_number:
            states[by_number[parts[0].split(".")[0]]] = PBS_STATES.get(parts[4], parts[4])
    return states
