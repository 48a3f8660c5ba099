"""Job-script text that labels every line with its rank, and ends a failed job with its first failure.

Pure text, no I/O. The labels are what :mod:`nodescale.launch.rank_logs` reads back:

- the launcher labels each task's lines: ``srun --label`` (``1: text``), PALS ``--label``,
  MPICH ``-prepend-rank`` (``[1] text``), Open MPI ``--tag-output`` (``[1,1]<stdout>:text``);
- in torchrun mode a task is a node, so torchrun labels its workers' lines with the global
  rank too (``--tee 3`` with ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, torch >= 2.2);
- each task sends its stderr to its stdout: one stream per rank keeps a traceback in order
  with the lines before it (Slurm's ``.err`` keeps srun's and the script's own messages).
"""

from __future__ import annotations

from nodescale.launch import shell
from nodescale.stop_signals import REQUEUE_FILE_VARIABLE

SRUN_LABEL = "--label"
MPIEXEC_LABEL = {"pals": "--label", "mpich": "-prepend-rank", "openmpi": "--tag-output"}

# Lines of the per-node and per-task scripts (inside single quotes: none may hold one).
ONE_STREAM = "exec 2>&1  # one stream per rank: its traceback stays in order with its other lines"
TORCHRUN_PREFIX = 'export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank\\${rank}]:"  # with --tee=3: each line its rank'
TORCHRUN_TEE = "--tee=3"

# The PBS log reaches the job directory only when the job ends (PBS spools it on the node):
# a copy of the script's output goes there as it is written, for `nodescale logs` and the summary.
PBS_LOG_NAME = "pbs-{job_number}.log"


def pbs_log_lines(job_dir: str, tasks_per_host: int) -> list[str]:
    """Send the rest of the script's output to a log file in the job directory as well; say where tasks run."""
    path = f'{shell.quote(job_dir.rstrip("/") + "/")}pbs-"${{PBS_JOBID%%.*}}".log'
    hosts = """$(awk '!seen[$0]++' "$PBS_NODEFILE" | paste -sd ' ')"""
    return [
        "# PBS copies the job's output to the job directory only at its end: a copy as it is written, for",
        "# `nodescale logs` (and --follow) and for the failure summary at the end.",
        f"ranks_log={path}",
        'exec > >(tee -a "$ranks_log") 2>&1',
        "# mpiexec's labels name no host: the failure summary finds a task's host from this line (first_failure).",
        f'echo "nodescale: mpiexec places {tasks_per_host} task(s) on each host, in this order: {hosts}"',
    ]


def failure_lines(job_id_var: str, logs: list[str]) -> list[str]:
    """After a failed step (``$step_status``), the first failed rank, its host and last lines.

    Not when the ranks stopped for requeue. ``logs`` are shell words naming the job's log files.
    """
    words = " ".join(logs)
    return [
        "# A failed step: the job log's last lines name the rank that failed first (not rank 0's lost peer).",
        f'if [ "$step_status" -ne 0 ] && [ ! -e "${{{REQUEUE_FILE_VARIABLE}:-/nonexistent}}" ]; then',
        f'{shell.INDENT}python3 -m nodescale.launch.first_failure "${job_id_var}" {words} 2>/dev/null || '
        f'echo "nodescale: the step failed (exit code $step_status): \\`nodescale logs ${job_id_var}\\` shows each '
        'rank\'s lines"',
        "fi",
    ]


def slurm_logs(job_dir: str) -> list[str]:
    """The Slurm job's .out and .err, as shell words (the job id expanded when the script runs)."""
    base = shell.quote(job_dir.rstrip("/") + "/") + 'slurm-"$SLURM_JOB_ID"'
    return [f"{base}.out", f"{base}.err"]


def with_status(launch: list[str]) -> list[str]:
    """A foreground launch that keeps its exit code in ``$step_status`` (``set -e`` would end the script)."""
    *head, last = launch
    return ["step_status=0", *head, f"{last} || step_status=$?"]
