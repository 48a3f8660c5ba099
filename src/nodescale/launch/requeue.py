"""The job-script lines that turn a stop signal into a checkpoint and a requeue (pure text, no I/O).

The shape, shared by the Slurm and PBS scripts:

1. the scheduler (Slurm's ``--signal=B:USR1@N``, PBS's ``qsig``, or the script's own wall-time
   timer on PBS) sends USR1 to the batch shell;
2. the shell runs the launch in the background and ``wait``s for it, so its trap runs at once
   (a foreground command would delay it until the command ends), and the trap passes USR1 on
   to srun/mpiexec, which pass it on to the ranks;
3. every rank stops at the same step boundary, checkpoints and exits with
   :data:`EXIT_REQUEUE`; rank 0 also writes ``$NODESCALE_REQUEUE_FILE``, because under torchrun
   the workers' exit code does not reach the script (torchrun exits 1 for any failed worker);
4. on either sign the script requeues the job (``scontrol requeue``, ``qrerun``); the requeued
   job runs the same command, which continues from the checkpoint when it has ``--resume``.
"""

from __future__ import annotations

from nodescale.launch import shell
from nodescale.stop_signals import EXIT_REQUEUE, REQUEUE_FILE_VARIABLE

SIGNAL = "USR1"
# Ignored by the launcher processes between the scheduler and the ranks (torchrun, nodescale's
# own local launcher): USR1's default action would kill them, and the step with them, while the
# ranks still write their checkpoint. Ignored signals stay ignored across exec; nodescale's
# ranks install their own handler. Double quotes: the per-node script sits in single quotes.
IGNORE_LINE = f'trap "" {SIGNAL}  # only the ranks act on the stop signal; it must not end this launcher'


def marker_lines(job_dir: str, job_id_var: str) -> list[str]:
    """Name the requeue marker of this job and remove one left by the job's previous run."""
    path = f"{job_dir.rstrip('/')}/requeue-"
    return [
        f"# Rank 0 writes {REQUEUE_FILE_VARIABLE} when the ranks stopped for requeue (torchrun hides their exit code).",
        f'export {REQUEUE_FILE_VARIABLE}={shell.quote(path)}"${job_id_var}"',
        f'rm -f "${REQUEUE_FILE_VARIABLE}"',
    ]


def background_launch(launch: list[str]) -> list[str]:
    """The launch lines run in the background, the stop signal passed on, and its exit code kept."""
    *head, last = launch
    return [
        "# In the background, so the trap runs when the signal comes; wait again until the launch has ended.",
        "step_pid=",
        f'trap \'echo "nodescale: {SIGNAL} received: passing it on to the ranks"; '
        f'kill -{SIGNAL} "$step_pid" 2>/dev/null || true\' {SIGNAL}',
        *head,
        f"{last} &",
        "step_pid=$!",
        "step_status=0",
        "while true; do",
        f'{shell.INDENT}wait "$step_pid" && step_status=0 || step_status=$?',
        f'{shell.INDENT}kill -0 "$step_pid" 2>/dev/null || break',
        "done",
    ]


def requeue_lines(requeue_command: str, what: str) -> list[str]:
    """Requeue when the ranks said so (exit code or marker); otherwise exit with the launch's code."""
    return [
        f"# Exit code {EXIT_REQUEUE} (or the marker): the ranks stopped on the signal and wrote a checkpoint.",
        f'if [ "$step_status" -eq {EXIT_REQUEUE} ] || [ -e "${REQUEUE_FILE_VARIABLE}" ]; then',
        f'{shell.INDENT}echo "nodescale: stopped for requeue (exit code $step_status): {what}"',
        f"{shell.INDENT}{requeue_command}",
        f"{shell.INDENT}exit 0",
        "fi",
        'exit "$step_status"',
    ]
