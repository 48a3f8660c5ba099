"""Render a complete sbatch script for a job on a Slurm cluster.

:func:`render_slurm` is a pure function of the :class:`JobSpec` and the :class:`Preset`:
the same inputs give the same text, byte for byte (the golden tests rely on it). Everything
that depends on the allocation (which nodes, their addresses, the job id and so the port) is
looked up by the script when it runs, never at render time.
"""

from __future__ import annotations

import re

from nodescale.errors import UserError
from nodescale.launch import job_array, option_directives, rank_labels, requeue, restarts, shell, software, startup
from nodescale.launch.after_step import before_exit, ended_lines
from nodescale.launch.spec import JobSpec, Preset

# The job's logs, inside spec.job_dir; %j is Slurm's job id.
STDOUT_NAME = "slurm-%j.out"
STDERR_NAME = "slurm-%j.err"

_PLAIN = re.compile(r"^[A-Za-z0-9_./:%=,@+-]+$")

_HEAD = [
    'job_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
    "head_node=${job_nodes%%$'\\n'*}",
    'head_info=$(scontrol show node "$head_node" 2>/dev/null) || head_info=""',
    "if [[ $head_info =~ NodeAddr=([^[:space:]]+) ]]; then head_addr=${BASH_REMATCH[1]}; "
    "else head_addr=$head_node; fi",
]

_WHY_HEAD = ["# Its address is Slurm's NodeAddr (scontrol): node names need not resolve on the compute nodes."]


def render_slurm(spec: JobSpec, preset: Preset) -> str:
    """The sbatch script that runs ``spec`` on the cluster ``preset`` describes.

    Raises ValueError for a spec the caller should have refused (a PBS preset, relative paths;
    the job's arithmetic is :func:`nodescale.launch.checks.check_job`'s) and :class:`UserError` for
    text that cannot go into the script safely (a newline in a directive value, an invalid variable name).
    """
    shell.check_renderable(spec, preset)
    preset = software.job_preset(spec, preset)
    env = shell.merged_env(preset.env, spec.env)
    blocks = [
        ["#!/bin/bash", *shell.header_lines(spec, preset), *(f"#SBATCH {d}" for d in directives(spec, preset))],
        shell.prologue_lines(
            spec, preset, ["# Run in the job's directory, whatever directory sbatch was called from."]
        ),
        job_array.index_lines(spec.array.indices, "slurm") if spec.array else [],
        shell.rendezvous_block(_HEAD, "SLURM_JOB_ID", env, _WHY_HEAD),
        *before_exit(run_lines(spec, preset), ended_lines(spec, preset)),
    ]
    return "\n".join(shell.paragraphs(blocks)) + "\n"


def directives(spec: JobSpec, preset: Preset) -> list[str]:
    """The ``#SBATCH`` options, without the prefix: resources, account, logs, the preset's, the command line's."""
    tasks = startup.tasks_per_node(spec)
    options = [
        f"--job-name={shell.safe_job_name(spec.job_name)}",
        f"--nodes={spec.nodes + spec.spare_nodes}",
        f"--ntasks-per-node={tasks}",
        f"--cpus-per-task={startup.cpus_per_task(spec, preset)}",
    ]
    options += gpu_options(spec, preset)
    options.append(f"--time={spec.time}")
    if spec.account:
        options.append(f"--account={word(spec.account, 'account')}")
    queue = spec.queue or preset.queue
    if queue:
        options.append(f"--partition={word(queue, 'partition')}")
    names = [job_array.slurm_log_name(name) if spec.array else name for name in (STDOUT_NAME, STDERR_NAME)]
    options += [f"--output={log_path(spec, names[0])}", f"--error={log_path(spec, names[1])}"]
    if spec.requeue:
        # B: signals the batch shell only; its trap passes the signal on to the job step. The logs
        # are appended to: a requeued job writes the same files again. Before the preset's lines,
        # which may override them.
        options += [f"--signal=B:{requeue.SIGNAL}@{spec.stop_warning_s}", "--requeue", "--open-mode=append"]
    options += restarts.slurm_directives(spec)
    if spec.array:
        options += job_array.slurm_directives(spec.array.indices, spec.array.max_concurrent)
    options += option_directives.slurm_lines(spec, preset, word)  # the preset's, less what the command line sets
    return options


def gpu_options(spec: JobSpec, preset: Preset) -> list[str]:
    """The GPU request in the form the cluster takes, or nothing for a CPU job."""
    count = spec.gpus_per_node
    if count == 0 or preset.gpu_request in ("none", "pbs-ngpus"):
        return []
    if preset.gpu_request == "gres":
        kind = f"gpu:{preset.gpu_type}:{count}" if preset.gpu_type else f"gpu:{count}"
        return [f"--gres={word(kind, 'GPU type')}"]
    return [f"--gpus-per-node={count}"]


def log_path(spec: JobSpec, name: str) -> str:
    """A log file in the job directory, as a directive value.

    ``%`` in the directory is doubled because Slurm expands ``%j``-style patterns in it, and a
    backslash is refused because Slurm then stops expanding ``%j`` in the whole name.
    """
    directory = str(spec.job_dir).rstrip("/") or "/"
    if "\\" in directory:
        raise UserError(f"job directory {directory!r}", "must not contain a backslash (Slurm log names)")
    return word(f"{directory.replace('%', '%%')}/{name}", "job directory")


def word(value: str, what: str) -> str:
    """``value`` as one argument of an ``#SBATCH`` line.

    sbatch splits directive lines itself: quotes group words, a backslash escapes the next
    character, and an unquoted ``#`` starts a comment. Plain values are left as they are.
    """
    shell.check_line(value, what)
    if _PLAIN.match(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_lines(spec: JobSpec, preset: Preset) -> list[list[str]]:
    """The launch (in a restart loop with ``--max-restarts``, :mod:`nodescale.launch.restarts`), then the
    failure summary; with requeue, in the background with the signal passed on, and requeue after it."""
    logs = job_array.slurm_log_words if spec.array else rank_labels.slurm_logs
    failed = rank_labels.failure_lines("SLURM_JOB_ID", logs(str(spec.job_dir)))
    launch = launch_lines(spec, preset)
    if restarts.enabled(spec):
        launch = restarts.with_srun_report(launch)
    run = requeue.background_launch(launch) if spec.requeue else rank_labels.with_status(launch)
    if restarts.enabled(spec):
        given = shell.merged_env(preset.env, spec.env)
        run = restarts.slurm_loop(spec, run, None if "MASTER_ADDR" in given else _HEAD[2:])
    if not spec.requeue:
        return [run, [*failed, 'exit "$step_status"']]
    signalled = (f"# Preemption and wall time: Slurm sends {requeue.SIGNAL} {spec.stop_warning_s} s before the end "
                 f"(or `scancel --signal={requeue.SIGNAL} --batch`);")
    if spec.stop_handler == "framework":
        why = [signalled, "# the framework in the ranks checkpoints and requeues the job itself (--stop-handler "
               "framework): nodescale does not."]
        return [why, run, [*failed, 'exit "$step_status"']]
    why = [signalled,
           "# the ranks checkpoint at the next step and exit, and the job is requeued (--resume continues it)."]
    return [
        [*why, *requeue.marker_lines(str(spec.job_dir), "SLURM_JOB_ID")],
        run,
        failed,
        requeue.requeue_lines(_requeue_command(spec), job_array.slurm_requeue_said(spec.array is not None),
                              spec.max_requeues),
    ]


def _requeue_command(spec: JobSpec) -> str:
    command = restarts.SLURM_REQUEUE if restarts.enabled(spec) else 'scontrol requeue "$SLURM_JOB_ID"'
    return job_array.slurm_requeue(command) if spec.array else command


def launch_lines(spec: JobSpec, preset: Preset) -> list[str]:
    """The comment and the ``srun`` line that start the job's processes, by mode."""
    options = [f"--cpus-per-task={startup.cpus_per_task(spec, preset)}", rank_labels.SRUN_LABEL]
    bind = startup.cpu_bind_for(spec, preset)
    if bind:
        options.append(f"--cpu-bind={bind}")
    why = ["# --cpus-per-task again: Slurm 22.05 to 23.02 do not pass the job's value on to steps."]
    catch = [requeue.CATCH_LINE] if spec.requeue else []
    if spec.mode == "spawn":
        launcher = ["srun", "--nodes=1", "--ntasks=1", *restarts.srun_options(spec), *options]
        comment = ["# Spawn mode: the command runs once, on one node, and starts its own processes.", *why]
        spawn_script = [*catch, 'exec "$@"'] if catch else None
        return [*comment, *startup.launch_command(launcher, preset.container, spawn_script, "nodescale-spawn",
                                                  spec.command)]
    options.append("--kill-on-bad-exit=1")
    why.append("# --kill-on-bad-exit: one failed task ends the step, not leaving the others waiting.")
    if spec.mode == "torchrun":
        launcher = ["srun", f"--nodes={spec.nodes}", "--ntasks-per-node=1", *restarts.srun_options(spec, spec.nodes),
                    *options]
        agent = startup.torchrun_script(spec.nodes, spec.nproc_per_node, "$SLURM_NODEID", "$SLURM_JOB_ID",
                                        gpus=spec.gpus_per_node > 0,
                                        agent=requeue.TORCHRUN_AGENT if spec.requeue else "torchrun")
        script = [requeue.IGNORE_LINE, *agent] if spec.requeue else agent
        comment = [f"# torchrun mode: one torchrun per node, each starting {spec.nproc_per_node} processes."]
        name = "nodescale-node"
    else:
        launcher = ["srun", f"--nodes={spec.nodes}", f"--ntasks-per-node={spec.nproc_per_node}",
                    *restarts.srun_options(spec, spec.world_size), *options]
        script = [*catch, *startup.per_task_script("$SLURM_PROCID", "$SLURM_LOCALID", "$SLURM_NTASKS",
                                                   spec.nproc_per_node, "$SLURM_NODEID")]
        comment = ["# per-gpu mode: one Slurm task per process, given torchrun's variables from Slurm's."]
        name = "nodescale-task"
    comment += [*why, startup.ARGS_COMMENT]
    return [*comment, *startup.launch_command(launcher, preset.container, script, name, spec.command)]
