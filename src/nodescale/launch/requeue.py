"""The job-script lines that turn a stop signal into a checkpoint and a requeue (pure text, no I/O).

The shape, shared by the Slurm and PBS scripts:

1. the scheduler (Slurm's ``--signal=B:USR1@N``, PBS's ``qsig``, or the script's own wall-time
   timer on PBS) sends USR1 to the batch shell;
2. the shell runs the launch in the background and ``wait``s for it, so its trap runs at once
   (a foreground command would delay it until the command ends), and the trap passes USR1 on
   to srun/mpiexec, which pass it on to the ranks. The processes in between survive it without
   handing an ignored signal on (:data:`CATCH_LINE`, :data:`TORCHRUN_AGENT`);
3. who acts on it is the job's stop handler (:mod:`nodescale.launch.stop_handler`). nodescale's
   ranks stop at the same step boundary, checkpoint, and rank 0 writes ``$NODESCALE_REQUEUE_FILE``
   with the step; a framework (Lightning) requeues the job itself;
4. the script requeues (``scontrol requeue``, ``qrerun``) on that marker only: an exit code proves
   nothing (any program may exit 3; torchrun exits 1 whatever its workers did). Not when the run
   stopped again at the step it resumed from (no progress), nor past ``--max-requeues``.
"""

from __future__ import annotations

from nodescale.launch import shell
from nodescale.stop_signals import EXIT_REQUEUE, REQUEUE_FILE_VARIABLE, REQUEUE_STEP_KEY

SIGNAL = "USR1"
# The per-task shell and spawn mode's one command survive the stop signal until their exec. Caught, not
# ignored: a caught signal is reset to its default across exec, an ignored one stays ignored, and a rank
# that starts with USR1 ignored gets no handler from Lightning (it takes any disposition but the default
# for one of the user's own). Double quotes: the per-node script sits in single quotes.
CATCH_LINE = f'trap ":" {SIGNAL}  # caught, not ignored: the program after exec starts with the default action'
# torchrun's agent: Slurm signals every process of the step, and the agent must outlive it. Its shell ignores
# the signal, which stays ignored across exec until the agent catches it itself, so that the workers it starts
# get the default action back (a caught signal is reset across exec).
IGNORE_LINE = f'trap "" {SIGNAL}  # the torchrun agent below catches it: its workers start with the default action'
# The torchrun on PATH, run by python3 once it catches the signal (the one interpreter the job script already
# relies on): no exec in between, which would reset the caught signal to its default action. A torchrun that
# is not a Python script (a site's wrapper) is exec'd as it is, the signal still ignored, as its workers find it.
TORCHRUN_AGENT = (
    'python3 -c "import os, runpy, shutil, signal, sys; '
    'path = shutil.which(\\"torchrun\\") or sys.exit(\\"torchrun: not found on PATH\\"); '
    'b\\"python\\" in open(path, \\"rb\\").readline() or os.execv(path, [path, *sys.argv[1:]]); '
    'signal.signal(signal.SIG' + SIGNAL + ', lambda *_: None); '
    'sys.argv[0] = path; runpy.run_path(path, run_name=\\"__main__\\")"'
)
_READ_STEP = f"sed -n 's/^{REQUEUE_STEP_KEY}=//p'"


def marker_lines(job_dir: str, job_id_var: str) -> list[str]:
    """Name the requeue marker and count of this job; keep the step the job's previous run stopped at."""
    base = shell.quote(f"{job_dir.rstrip('/')}/")
    return [
        f"# Rank 0 writes {REQUEUE_FILE_VARIABLE}, with its checkpoint's step, once every rank stopped for requeue:",
        "# the only evidence believed (any program may exit 3, and torchrun exits 1 whatever its workers did).",
        f'export {REQUEUE_FILE_VARIABLE}={base}requeue-"${job_id_var}"',
        f'requeue_count_file={base}requeues-"${job_id_var}"',
        "# A requeued job keeps its id: the step its previous run stopped at, where stopping again is no progress.",
        f'previous_stop=$({_READ_STEP} "${REQUEUE_FILE_VARIABLE}" 2>/dev/null) || previous_stop=""',
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


def requeue_lines(requeue_command: str, what: str, max_requeues: int) -> list[str]:
    """Requeue on the marker, unless the run made no progress or was requeued ``max_requeues`` times; else exit
    with the launch's code (3 after a stop that is not requeued: the run is not finished)."""
    i = shell.INDENT
    return [
        "# Requeued on the marker only; not when the run stopped again where it resumed, nor past --max-requeues.",
        f'if [ -e "${REQUEUE_FILE_VARIABLE}" ]; then',
        f'{i}stop_step=$({_READ_STEP} "${REQUEUE_FILE_VARIABLE}")',
        f'{i}requeues=$(cat "$requeue_count_file" 2>/dev/null) || requeues=0',
        f"{i}[[ $requeues =~ ^[0-9]+$ ]] || requeues=0",
        f'{i}if [ -n "$previous_stop" ] && [ "$stop_step" = "$previous_stop" ]; then',
        f'{i * 2}echo "nodescale: stopped again at step $stop_step, where the previous run stopped: not requeued, '
        'it made no progress (does the command resume from its checkpoint?)"',
        f'{i}elif [ "$requeues" -ge {max_requeues} ]; then',
        f'{i * 2}echo "nodescale: stopped at step $stop_step: not requeued, the job was requeued $requeues times '
        f'already (--max-requeues {max_requeues})"',
        f"{i}else",
        f'{i * 2}echo "$((requeues + 1))" > "$requeue_count_file"',
        f'{i * 2}echo "nodescale: stopped for requeue at step $stop_step (requeue $((requeues + 1)) of '
        f'{max_requeues}): {what}"',
        f"{i * 2}{requeue_command}",
        f"{i * 2}exit 0",
        f"{i}fi",
        f"{i}step_status={EXIT_REQUEUE}",
        f'elif [ "$step_status" -eq {EXIT_REQUEUE} ]; then',
        f'{i}echo "nodescale: the step exited with {EXIT_REQUEUE} but no rank wrote the requeue marker (no stop at a '
        'checkpoint): a failure, not requeued"',
        "fi",
        'exit "$step_status"',
    ]
