"""Restarts inside a cluster job: the job script runs its step again after a failure (pure text, no I/O).

torchrun's own ``--max-restarts`` cannot heal a lost node: losing a node ends that node's agent,
and srun's ``--kill-on-bad-exit`` ends the step. So the loop lives in the batch script
(``nodescale launch --max-restarts N``):

1. Slurm: the job asks for ``--nodes`` + ``--spare-nodes`` nodes with ``--no-kill``, so that a
   failed node does not end the job; each run of the step takes the first ``--nodes`` of them
   that have not failed (``srun --nodelist``), so WORLD_SIZE stays the same;
2. after a failed step, srun's own report (``srun: error: node3: task 1: Killed``, ``Node
   failure on node3``) names the node whose processes died: it is left out of the next run while
   enough nodes remain, and out of the requeued job (``ExcNodeList``, which Slurm takes only once
   the job is pending again). A rank that merely exited with an error leaves its node in. The list
   lives in the job's bad-node file (:mod:`nodescale.bad_nodes`), where ``nodescale doctor`` and
   ``bench comm --pairs`` add the nodes they flag: the next run and the requeue leave those out too;
3. a user error (exit code 2, or a rank's message in ``NODESCALE_ERROR_DIR``, the local
   launcher's mechanism) ends the job: it would fail the same way again. A stop for requeue
   (the ranks' requeue marker, not an exit code) is requeued as before and is not counted;
4. the restarted ranks see ``NODESCALE_RESTART_COUNT``, as under nodescale's local launcher, and
   resume from the newest whole checkpoint (:func:`~.local_launcher.current_restart`).

PBS Pro cannot take a node out of a running job, and each mpiexec flavour reports a failed host
in words of its own: PBS restarts run mpiexec again on the same hosts, and ``--spare-nodes`` is
refused there (:func:`check_restarts`).
"""

from __future__ import annotations

from nodescale import bad_nodes
from nodescale.bad_nodes import VARIABLE as BAD_NODES_VARIABLE
from nodescale.errors import EXIT_USER_ERROR, UserError
from nodescale.launch import shell
from nodescale.launch.schedulers.local_launcher import (
    ERROR_DIR_VARIABLE,
    MAX_RESTARTS_VARIABLE,
    RESTART_COUNT_VARIABLE,
    RESTART_REASON_VARIABLE,
)
from nodescale.launch.spec import JobSpec, Preset
from nodescale.stop_signals import REQUEUE_FILE_VARIABLE

# What the ranks read: Open MPI's mpiexec passes on only the variables named with -x.
VARIABLES = (RESTART_COUNT_VARIABLE, MAX_RESTARTS_VARIABLE, RESTART_REASON_VARIABLE, ERROR_DIR_VARIABLE)

# srun's own lines about its tasks, copied from its stderr into the step's report file.
_AWK = ('{ print; fflush() } /^srun: error: / { print >> report; fflush(report) } '
        'END { close(report); printf "" > (report ".done") }')
# A node whose tasks were killed by a signal nobody in the step sent first, or that Slurm lost.
_NODE_LOST = r"^srun: error: ([^ :]+): tasks? [0-9,-]+: Killed|^srun: error: Node failure on ([^ ]+)"

# TERM ignored: the requeue ends this script, and Slurm takes ExcNodeList only once the job is pending again.
# ExcNodeList replaces the job's list: the submission's --exclude goes in again.
SLURM_REQUEUE = ("trap '' TERM; load_bad_nodes; scontrol requeue \"$SLURM_JOB_ID\"; [ -z \"$bad_nodes\" ] || { "
                 'scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="${excluded:+$excluded,}$bad_nodes" && echo '
                 '"nodescale: the requeued job leaves out $bad_nodes"; }')
# Adds the bad-node file's new hosts (nodescale.bad_nodes: HOST<TAB>REASON) to $bad_nodes, naming each.
_LOAD_BAD_NODES = [
    "load_bad_nodes() {",
    f'{shell.INDENT}[ -r "${BAD_NODES_VARIABLE}" ] || return 0',
    f"{shell.INDENT}local node why",
    f"{shell.INDENT}while IFS=$'\\t' read -r node why || [ -n \"$node\" ]; do",
    f"{shell.INDENT * 2}[[ $node =~ ^{bad_nodes.HOST.pattern}$ && \",$bad_nodes,\" != *\",$node,\"* ]] || continue",
    f'{shell.INDENT * 2}bad_nodes=${{bad_nodes:+$bad_nodes,}}$node; echo "nodescale: leaving node $node out: $why"',
    f'{shell.INDENT}done < "${BAD_NODES_VARIABLE}"',
    "}",
]


def enabled(spec: JobSpec) -> bool:
    """Whether the job script runs its step in a restart loop."""
    return spec.max_restarts > 0 or spec.spare_nodes > 0


def check_restarts(spec: JobSpec, preset: Preset) -> None:
    """UserError for restart settings the scheduler cannot honour."""
    if spec.spare_nodes and preset.scheduler == "pbs":
        raise UserError(f"--spare-nodes {spec.spare_nodes} with PBS",
                        "PBS Pro cannot take a failed node out of a running job, and nodescale cannot tell from "
                        "mpiexec which host failed, so a spare would never be used",
                        "drop --spare-nodes: --max-restarts runs mpiexec again on the same hosts")


def slurm_directives(spec: JobSpec) -> list[str]:
    """``--no-kill``: a failed node leaves the job running, so the next step can run without it."""
    return ["--no-kill"] if enabled(spec) else []


def srun_options(spec: JobSpec, tasks: int | None = None) -> list[str]:
    """The nodes the loop chose and the step's own task count (the job's counts its spare nodes too)."""
    if not enabled(spec):
        return []
    return [*([f"--ntasks={tasks}"] if tasks else []), shell.Expansion('--nodelist="$step_nodes"')]


def with_srun_report(launch: list[str]) -> list[str]:
    """The launch with srun's stderr passed through, its ``srun: error:`` lines also kept in ``$step_report``."""
    *head, last = launch
    return [*head, f'{last} 2> >(awk -v report="$step_report" {shell.quote(_AWK)} >&2)']


def slurm_loop(spec: JobSpec, run: list[str], head_lines: list[str] | None) -> list[str]:
    """The restart loop around ``run`` (the launch, in the background or not) for a Slurm job.

    ``head_lines`` set ``head_addr`` from ``head_node`` (None where MASTER_ADDR is given): the
    rendezvous moves to the step's first node when the job's first node is left out.
    """
    n = spec.nodes
    rendezvous = [*head_lines, shell.master_addr_line()] if head_lines is not None else []
    choose = [
        "load_bad_nodes  # srun's killed nodes, and those nodescale doctor or bench comm --pairs flagged",
        f"# The first {n} nodes that have not failed; failed ones only when too few others are left.",
        'good="" suspect="" good_count=0',
        'for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        f'{shell.INDENT}if [[ ",$bad_nodes," == *",$node,"* ]]; then suspect="$suspect $node"; '
        'else good="$good $node"; good_count=$((good_count + 1)); fi',
        "done",
        f'if [ "$good_count" -lt {n} ]; then',
        f'{shell.INDENT}echo "nodescale: only $good_count nodes have not failed, {n} needed: using $bad_nodes again '
        '(--spare-nodes keeps nodes in reserve)"',
        "fi",
        'step_nodes="" count=0',
        "for node in $good $suspect; do",
        f'{shell.INDENT}if [ "$count" -lt {n} ]; then step_nodes=${{step_nodes:+$step_nodes,}}$node; '
        "count=$((count + 1)); fi",
        "done",
        "head_node=${step_nodes%%,*}",
        *rendezvous,
        'echo "nodescale: step on $step_nodes${bad_nodes:+ (left out: $bad_nodes)}, rendezvous at '
        '$MASTER_ADDR:$MASTER_PORT"',
    ]
    wait_report = [
        "# srun's report goes through a filter: wait (a few seconds at most) until it has written everything.",
        'for _ in $(seq 1 100); do [ -e "$step_report.done" ] && break; sleep 0.1; done',
        "first=$(grep -m 1 -E '^srun: error: (Node failure on |[^ :]+: tasks? )' \"$step_report\" 2>/dev/null) "
        '|| first=""',
    ]
    lost = [
        'if [[ $first =~ $node_lost ]]; then',
        f"{shell.INDENT}node=${{BASH_REMATCH[1]}}${{BASH_REMATCH[2]}}",
        f"{shell.INDENT}printf '%s\\t%s\\n' \"$node\" \"its processes died (${{first#srun: error: }})\" "
        f'>> "${BAD_NODES_VARIABLE}"',
        f'{shell.INDENT}NODESCALE_RESTART_REASON="node $node failed (${{first#srun: error: }})"',
        "fi",
    ]
    setup = [
        f'step_report={_job_file(spec, "step-", "SLURM_JOB_ID")}.txt',
        f"node_lost={shell.quote(_NODE_LOST)}",
        f'export {BAD_NODES_VARIABLE}={_job_file(spec, "bad-nodes-", "SLURM_JOB_ID")}.txt',
        *([f"excluded={shell.quote(','.join(spec.options.exclude))}"] if spec.options.exclude else []),
        'bad_nodes=""',
        *_LOAD_BAD_NODES,
    ]
    user_error = [
        "grep -q ': Exited with exit code 2$' \"$step_report\" 2>/dev/null"]
    return _loop(spec, "SLURM_JOB_ID", setup, ['rm -f "$step_report" "$step_report.done"', *choose], run,
                 wait_report, user_error, lost, "", also_stderr=True)


def pbs_loop(spec: JobSpec, run: list[str]) -> list[str]:
    """The restart loop around ``run`` for a PBS job: mpiexec again on the same hosts."""
    return _loop(spec, "PBS_JOBID", [], [], run, [], [], [],
                 " on the same hosts (PBS cannot take a host out of a running job)")


def _job_file(spec: JobSpec, prefix: str, job_id_var: str) -> str:
    """A file of this job in the job directory (shared by the nodes), as a shell word."""
    return f'{shell.quote(str(spec.job_dir).rstrip("/") + "/" + prefix)}"${job_id_var}"'


def _loop(spec: JobSpec, job_id_var: str, setup: list[str], top: list[str], run: list[str], after: list[str],
          user_error_tests: list[str], diagnose: list[str], where: str, also_stderr: bool = False) -> list[str]:
    limit, indent = spec.max_restarts, shell.INDENT  # ``run`` sets $step_status (the caller exits with it)
    errors = f'"${ERROR_DIR_VARIABLE}"'
    user_error = " || ".join([f'[ "$step_status" -eq {EXIT_USER_ERROR} ]', f'[ -n "$(ls -A {errors})" ]',
                              *user_error_tests])
    requeued = ([f'if [ -e "${REQUEUE_FILE_VARIABLE}" ]; then break; fi  # stopped for requeue, not failed']
                if spec.stop_handler == "nodescale" else [])
    body = [
        f'rm -rf {errors} && mkdir -p {errors}',
        f"export {RESTART_COUNT_VARIABLE}=$restart {RESTART_REASON_VARIABLE}",
        *top,
        *run,
        *requeued,
        'if [ "$step_status" -eq 0 ]; then break; fi',
        *after,
        f"if {user_error}; then",
        f'{indent}for file in {errors}/rank-*.txt; do',
        f'{indent * 2}[ -e "$file" ] || continue',
        f'{indent * 2}rank=${{file##*/rank-}}; echo "nodescale: error (rank ${{rank%.txt}}): $(cat "$file")"; break',
        f"{indent}done",
        f'{indent}echo "nodescale: the step stopped on a user error (exit code {EXIT_USER_ERROR}): not restarted, '
        'it would fail the same way again"',
        f"{indent}step_status={EXIT_USER_ERROR}; break",
        "fi",
        f'if [ "$restart" -ge {limit} ]; then',
        f'{indent}echo "nodescale: the step failed (exit code $step_status) after {limit} restart(s)'
        '${first:+: $first}"',
        f"{indent}break",
        "fi",
        f'{RESTART_REASON_VARIABLE}="the step exited with $step_status"',
        *diagnose,
        "restart=$((restart + 1))",
        f'echo "nodescale: restart $restart of {limit}{where}: the ranks resume from the newest checkpoint"',
        # The failure summary reads each log file from its last restart line on (first_failure.last_attempt).
        *([f'echo "nodescale: restart $restart of {limit}" >&2  # srun reports failures in the .err file']
          if also_stderr else []),
    ]
    why = [
        f"# Restarts (nodescale launch --max-restarts {limit}): the step runs again after a failure, and its ranks",
        f"# resume from the newest checkpoint ({RESTART_COUNT_VARIABLE}). A user error (exit code {EXIT_USER_ERROR},",
        f"# or a rank's message in {ERROR_DIR_VARIABLE}) is not retried; a stop for requeue is requeued.",
    ]
    return [
        *why,
        f"export {MAX_RESTARTS_VARIABLE}={limit}",
        f"export {ERROR_DIR_VARIABLE}={_job_file(spec, 'errors-', job_id_var)}",
        *setup,
        'restart=0 first=""',
        f'{RESTART_REASON_VARIABLE}=""',
        "while true; do",
        *(f"{indent}{line}" if line else "" for line in body),
        # Every way out of the loop ends here: the PBS wall-time timer is stopped, the failure summarised,
        # then the requeue test, or the exit with this code.
        "done",
    ]
