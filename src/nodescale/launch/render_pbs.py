"""Render a complete PBS Pro script for a job on a PBS cluster (NCAR Derecho and the like).

:func:`render_pbs` is a pure function of the :class:`JobSpec` and the :class:`Preset`: the
same inputs give the same text, byte for byte. The head node, its address and the port are
looked up by the script when it runs, from ``$PBS_NODEFILE`` and ``$PBS_JOBID``.

Processes are started with the preset's ``mpiexec``: Cray PALS (``--ppn``, ``--cpu-bind``),
MPICH's Hydra (``-ppn``, ``-bind-to``; it refuses ``--cpu-bind``) or Open MPI
(``--map-by ppr:N:node``, ``--bind-to``, and ``-x`` for the variables its remote daemons must
pass on).
"""

from __future__ import annotations

import re

from nodescale.errors import UserError
from nodescale.launch import job_array, option_directives, rank_labels, requeue, restarts, shell, software, startup
from nodescale.launch.after_step import before_exit, ended_lines
from nodescale.launch.spec import JobSpec, Preset, walltime_seconds

# PBS Pro refuses longer job names.
MAX_JOB_NAME = 236

# qsub splits directive lines on whitespace and has quoting rules of its own; values are
# kept to characters that need none.
_PLAIN = re.compile(r"^[^\s'\"\\#]+$")

_PLACE = re.compile(r"^\s*-l\s*place=")

_HEAD = [
    'head_node=$(head -n 1 "$PBS_NODEFILE")',
    "head_addr=$head_node",
]

_WHY_HEAD = [
    "# $PBS_NODEFILE lists the hosts, the first first; resolved here: the login node may resolve names otherwise.",
]

# Rank variables of the supported mpiexec flavours, first match wins: PALS, MPICH, Open MPI.
_RANK = "${PALS_RANKID:-${PMI_RANK:-${OMPI_COMM_WORLD_RANK:?mpiexec set no rank variable}}}"
_LOCAL_RANK = (
    "${PALS_LOCAL_RANKID:-${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:?mpiexec set no local rank variable}}}"
)
# With one process per node the MPI rank is the node's index. No fallback to 0: every node
# would then host the rendezvous store and the job would hang instead of failing at once.
_TORCHRUN_SIGNALS = f"export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIG{requeue.SIGNAL}"
_NODE_RANK = "${PALS_NODEID:-${PMI_RANK:-${OMPI_COMM_WORLD_RANK:?mpiexec set no rank variable}}}"


def render_pbs(spec: JobSpec, preset: Preset) -> str:
    """The qsub script that runs ``spec`` on the cluster ``preset`` describes.

    Raises ValueError for a spec the caller should have refused (a Slurm preset, relative paths;
    the job's arithmetic is :func:`nodescale.launch.checks.check_job`'s) and :class:`UserError` for
    text that cannot go into the script safely (whitespace or quotes in a directive value, an invalid variable name).
    """
    shell.check_renderable(spec, preset)
    preset = software.job_preset(spec, preset)
    env = shell.merged_env(preset.env, spec.env)
    cd_comment = [
        "# PBS starts the job in the home directory, not where qsub ran: go to the job's directory",
        "# (an absolute path, so nothing depends on $PBS_O_WORKDIR).",
    ]
    blocks = [
        ["#!/bin/bash", *shell.header_lines(spec, preset), *(f"#PBS {d}" for d in directives(spec, preset))],
        shell.prologue_lines(spec, preset, cd_comment),
        rank_labels.pbs_log_lines(str(spec.job_dir), spec.nproc_per_node if spec.mode == "per-gpu" else 1),
        job_array.index_lines(spec.array.indices, "pbs") if spec.array else [],
        shell.rendezvous_block(_HEAD, "PBS_JOBID", env, _WHY_HEAD),
        *before_exit(run_lines(spec, preset, [*env, job_array.INDEX_VARIABLE] if spec.array else list(env)),
                     ended_lines(spec, preset)),
    ]
    return "\n".join(shell.paragraphs(blocks)) + "\n"


def directives(spec: JobSpec, preset: Preset) -> list[str]:
    """The ``#PBS`` options, without the prefix: name, resources, account, queue, log, the preset's."""
    options = [
        f"-N {shell.safe_job_name(spec.job_name, limit=MAX_JOB_NAME)}",
        f"-l select={select(spec, preset)}",
    ]
    if not any(_PLACE.match(line) for line in [*preset.directives, *spec.options.directives]):
        # One chunk per host: otherwise PBS may pack two chunks onto one node, and the launch
        # (one torchrun or one block of ranks per node) would put two nodes' work on it.
        options.append("-l place=scatter")
    options.append(f"-l walltime={walltime(spec.time)}")
    if spec.account:
        options.append(f"-A {word(spec.account, 'account')}")
    queue = option_directives.pbs_queue(spec, preset)
    if queue:
        options.append(f"-q {word(queue, 'queue')}")
    options += ["-j oe", f"-o {word(str(spec.job_dir).rstrip('/') + '/', 'job directory')}"]
    if spec.array:
        options += job_array.pbs_directives(spec.array.indices, spec.array.max_concurrent)
    options += option_directives.pbs_lines(spec, preset)  # the preset's, less what the command line sets
    return options


def select(spec: JobSpec, preset: Preset) -> str:
    """The ``select`` chunks: whole nodes (or --cpus-per-task per task), their GPUs when PBS counts them, tasks per
    node, then --mem and --nodelist's hosts."""
    tasks = startup.tasks_per_node(spec)
    cpus = preset.cpus_per_node if spec.options.cpus_per_task is None else spec.options.cpus_per_task * tasks
    chunk = f"ncpus={cpus}"
    if preset.gpu_request == "pbs-ngpus" and spec.gpus_per_node > 0:
        chunk += f":ngpus={spec.gpus_per_node}"
    return option_directives.pbs_select(spec, f"{chunk}:mpiprocs={tasks}")


def walltime(time: str) -> str:
    """``D-HH:MM:SS`` as PBS's ``HH:MM:SS`` (hours past 24 allowed); ``HH:MM:SS`` unchanged."""
    days, _, clock = time.rpartition("-")
    if not days:
        return clock
    hours, rest = clock.split(":", 1)
    return f"{int(days) * 24 + int(hours):02d}:{rest}"


def word(value: str, what: str) -> str:
    """``value`` unchanged if a ``#PBS`` line can hold it as one word; else :class:`UserError`."""
    shell.check_line(value, what)
    if not _PLAIN.match(value):
        raise UserError(
            f"{what} {value!r}",
            "cannot be written in a #PBS directive: no whitespace, quotes, backslashes or '#'",
        )
    return value


def mpiexec_words(spec: JobSpec, preset: Preset, total: int, per_node: int, env_names: list[str]) -> list[str]:
    """``mpiexec`` starting ``total`` processes, ``per_node`` on each node, in the preset's flavour."""
    bind = startup.cpu_bind_for(spec, preset) or "none"
    label = rank_labels.MPIEXEC_LABEL[preset.mpiexec]
    if preset.mpiexec == "pals":
        return ["mpiexec", "-n", str(total), "--ppn", str(per_node), "--cpu-bind", bind, label]
    if preset.mpiexec == "mpich":
        return ["mpiexec", "-n", str(total), "-ppn", str(per_node), "-bind-to", bind, label]
    # The node file names the hosts: an Open MPI built without PBS's TM interface (Debian's,
    # many conda ones) sees only the local host otherwise. PBS_JOBID must travel with -x: it
    # is the rendezvous id, and nodes with different ids never meet.
    words = ["mpiexec", "-n", str(total), "--hostfile", shell.Expansion('"$PBS_NODEFILE"'),
             "--map-by", f"ppr:{per_node}:node", "--bind-to", bind, label]
    for name in dict.fromkeys(["PATH", "MASTER_ADDR", "MASTER_PORT", "PBS_JOBID", *env_names]):
        words += ["-x", name]
    return words


def run_lines(spec: JobSpec, preset: Preset, env_names: list[str]) -> list[list[str]]:
    """The launch; with requeue, in the background with the signal passed on and ``qrerun`` after it."""
    failed = rank_labels.failure_lines("PBS_JOBID", ['"$ranks_log"'])
    if restarts.enabled(spec):
        env_names = [*env_names, *restarts.VARIABLES]
    if not spec.requeue:
        return [_restart_loop(spec, rank_labels.with_status(launch_lines(spec, preset, env_names))),
                [*failed, 'exit "$step_status"']]
    lead = spec.stop_warning_s
    timer_at = walltime_seconds(spec.time) - lead
    why = [
        f"# Preemption and wall time: PBS warns no one, so the script sends itself {requeue.SIGNAL} {lead} s before "
        f"the end (`qsig -s {requeue.SIGNAL} JOBID`",
        "# at any time); mpiexec passes it on, the ranks checkpoint and exit, qrerun reruns the job (--resume).",
    ]
    # Its output goes nowhere and it is stopped after the launch: it must not keep the job's output open.
    timer = [f"( sleep {timer_at} && kill -{requeue.SIGNAL} $$ ) >/dev/null 2>&1 &", "timer_pid=$!"]
    stop_timer = ['kill "$timer_pid" 2>/dev/null || true']
    if timer_at <= 0:
        timer = stop_timer = []
    return [
        [*why, *requeue.marker_lines(str(spec.job_dir), "PBS_JOBID"), *timer],
        [*_restart_loop(spec, requeue.background_launch(
            launch_lines(spec, preset, [*env_names, requeue.REQUEUE_FILE_VARIABLE]))), *stop_timer],
        failed,
        requeue.requeue_lines('qrerun "$PBS_JOBID"', "rerunning PBS job $PBS_JOBID", spec.max_requeues),
    ]


def _restart_loop(spec: JobSpec, run: list[str]) -> list[str]:
    return restarts.pbs_loop(spec, run) if restarts.enabled(spec) else run


def launch_lines(spec: JobSpec, preset: Preset, env_names: list[str]) -> list[str]:
    """The comment and the ``mpiexec`` line that start the job's processes, by mode."""
    nodes, nproc = spec.nodes, spec.nproc_per_node
    why = ["# CPU binding off unless the preset sets one: a launcher bound to one core shares it with its processes."]
    if preset.mpiexec == "openmpi":
        why.append("# -x: Open MPI's daemons on other nodes pass on only the variables named so.")
    catch = [requeue.CATCH_LINE] if spec.requeue else []
    if spec.mode == "spawn":
        launcher = mpiexec_words(spec, preset, 1, 1, env_names)
        comment = ["# Spawn mode: the command runs once, on one node, and starts its own processes.", *why]
        spawn_script = [*catch, 'exec "$@"'] if catch else None
        return [*comment, *startup.launch_command(launcher, preset.container, spawn_script, "nodescale-spawn",
                                                  spec.command)]
    if spec.mode == "torchrun":
        launcher = mpiexec_words(spec, preset, nodes, 1, env_names)
        script = startup.torchrun_script(nodes, nproc, _NODE_RANK, "$PBS_JOBID", gpus=spec.gpus_per_node > 0)
        if spec.requeue:
            # mpiexec signals torchrun only, not its workers: torchrun passes USR1 on when told to
            # handle it (and gives the workers its --shutdown-timeout, 30 s, before killing them).
            script = [_TORCHRUN_SIGNALS, *script]
        comment = [f"# torchrun mode: one torchrun per node, each starting {nproc} processes."]
        name = "nodescale-node"
    else:
        launcher = mpiexec_words(spec, preset, nodes * nproc, nproc, env_names)
        # PALS names the node; MPICH and Open MPI place ranks in blocks of nproc per node.
        script = [*catch, *startup.per_task_script(_RANK, _LOCAL_RANK, str(nodes * nproc), nproc,
                                                    f"${{PALS_NODEID:-$(( RANK / {nproc} ))}}")]
        comment = ["# per-gpu mode: one MPI rank per process, given torchrun's variables from the MPI ones."]
        name = "nodescale-task"
    comment += [*why, startup.ARGS_COMMENT]
    return [*comment, *startup.launch_command(launcher, preset.container, script, name, spec.command)]
