"""How a job script starts its processes on the nodes, shared by both job-script renderers.

The launch line, the per-node (torchrun) and per-task scripts it runs, the preset's container
around them, and the task and CPU layout that the directives and launcher flags ask for. The
batch script's other lines, and the quoting every user string goes through, are
:mod:`nodescale.launch.shell`.

The user's command is never re-quoted into an inner script: launch lines run
``bash -c '<script>' NAME COMMAND...`` and the script ends in ``exec ... "$@"``, so the
command's words arrive in the program's argv exactly as given.

A preset's container ``setup`` lines are trusted shell and are written verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence

from nodescale.distributed.cpu_binding import PER_TASK_BINDINGS
from nodescale.launch.rank_labels import ONE_STREAM, TORCHRUN_PREFIX, TORCHRUN_TEE
from nodescale.launch.shell import INDENT, join, quote
from nodescale.launch.spec import Container, JobSpec, Preset

ARGS_COMMENT = '# The command reaches the script below as its arguments ("$@"), never re-quoted.'


def local_addr_line() -> str:
    """Shell that sets ``local_addr`` to this node's address on the route to MASTER_ADDR.

    A UDP ``connect`` sends nothing; it only makes the kernel pick the source address the other
    nodes will see. torchrun's own guess comes from the host name, which often resolves to a
    loopback address, and then workers on other nodes cannot reach this one.
    """
    probe = (
        "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
        "s.connect((sys.argv[1], int(sys.argv[2]))); print(s.getsockname()[0])"
    )
    return f'local_addr=$(python3 -c "{probe}" "$MASTER_ADDR" "$MASTER_PORT" 2>/dev/null) || local_addr=$(hostname)'


NUMA_BINDING = [
    "# Each rank bound to the NUMA node of its GPU, where this torch and this node allow it (numa_binding.py).",
    "numa_binding=$(python3 -m nodescale.launch.numa_binding 2>/dev/null) || numa_binding=",
]


def torchrun_script(nnodes: int, nproc_per_node: int, node_rank: str, rdzv_id: str, gpus: bool = False,
                    agent: str = "torchrun") -> list[str]:
    """The per-node script that starts torchrun, as lines without single quotes.

    ``node_rank`` and ``rdzv_id`` are shell expressions evaluated on each node (for example
    ``$SLURM_NODEID``). The store's node is told so with ``is_host=1`` and every other node
    with ``is_host=0``: left to guess, nodes that share addresses (or none) time out. ``agent``:
    the command that runs torchrun (:data:`nodescale.launch.requeue.TORCHRUN_AGENT` with a stop signal).
    """
    numa = " $numa_binding" if gpus else ""
    return [
        "# On every node. The first hosts the store (is_host=1); local_addr is this node as the others",
        "# reach it (its route to MASTER_ADDR), where torchrun would guess from the host name (often loopback).",
        f"node_rank={node_rank}",
        'if [ "$node_rank" = 0 ]; then is_host=1; else is_host=0; fi',
        local_addr_line(),
        ONE_STREAM,
        TORCHRUN_PREFIX,
        *(NUMA_BINDING if gpus else []),
        # No --node-rank: the c10d rendezvous assigns node ranks itself, and torchrun warns
        # on every node that the flag is ignored.
        f'exec {agent} --nnodes={nnodes} --nproc-per-node={nproc_per_node} \\',
        f'{INDENT}--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="{rdzv_id}" \\',
        f'{INDENT}--rdzv-conf=is_host="$is_host" --local-addr="$local_addr" {TORCHRUN_TEE}{numa} --no-python "$@"',
    ]


def per_task_script(rank: str, local_rank: str, world_size: str, local_world_size: int,
                    node_rank: str) -> list[str]:
    """The per-task script of per-gpu mode: torchrun's variables from the scheduler's, then the command.

    The arguments are shell expressions evaluated in each task. GROUP_RANK and NODE_RANK carry
    the node's index: frameworks that read torchrun's variables (Lightning outside its Slurm
    detection, say) otherwise take every task for node 0.
    """
    return [
        ONE_STREAM,
        f"export RANK={rank}",
        f"export LOCAL_RANK={local_rank}",
        f"export WORLD_SIZE={world_size} LOCAL_WORLD_SIZE={local_world_size}",
        f"export GROUP_RANK={node_rank}",
        "export NODE_RANK=$GROUP_RANK",
        'exec "$@"',
    ]


def container_words(container: Container | None) -> list[str]:
    """``singularity exec [--bind a,b] IMAGE`` for the preset's container; nothing without one."""
    if container is None:
        return []
    words = [container.runtime, "exec"]
    if container.binds:
        words += ["--bind", ",".join(container.binds)]
    return [*words, container.image]


def launch_command(
    launcher: Sequence[str],
    container: Container | None,
    script: Sequence[str] | None,
    name: str,
    command: Sequence[str],
) -> list[str]:
    """The launch line, one line per part, joined with backslash continuations.

    ``launcher`` (srun/mpiexec and flags) starts ``script`` (run by ``bash -c`` as ``name``,
    with the user's ``command`` as ``"$@"``) inside the preset's container, if any. The
    container's setup lines run first, under ``set -e``. With no script and no container
    setup, the command is started directly.
    """
    setup = list(container.setup) if container else []
    if setup:
        script = ["set -e", *setup, *(script or ['exec "$@"'])]
    parts = [join(launcher)] if launcher else []  # none: run in the batch shell itself (after_step.py)
    if container is not None:
        parts.append(join(container_words(container)))
    if script is None:
        parts.append(join(command))
    else:
        body = "\n".join(f"{INDENT * 2}{line}" for line in script)
        parts += [f"bash -c {quote(chr(10) + body + chr(10) + INDENT)}", join([name, *command])]
    return (" \\\n" + INDENT).join(parts).split("\n")


def tasks_per_node(spec: JobSpec) -> int:
    """Scheduler tasks per node: one launcher per node (torchrun, spawn) or one per process."""
    return spec.nproc_per_node if spec.mode == "per-gpu" else 1


def cpus_per_task(spec: JobSpec, preset: Preset) -> int:
    """The cores of the GPUs asked for, shared out between the node's tasks (at least one each).

    A job with 1 of a node's 4 GPUs gets a quarter of its cores: clusters such as Puhti
    refuse (or bill for) more, and the rest of the node stays usable for other jobs. ``--cpus-per-task``
    overrides the rule.
    """
    if spec.options.cpus_per_task is not None:
        return spec.options.cpus_per_task
    cores = preset.cpus_per_node
    if 0 < spec.gpus_per_node < preset.gpus_per_node:
        cores = cores * spec.gpus_per_node // preset.gpus_per_node
    return max(1, cores // tasks_per_node(spec))


def cpu_bind_for(spec: JobSpec, preset: Preset) -> str | None:
    """The preset's CPU binding for this job's launch, or None where it does not apply.

    A per-task list (PER_TASK_BINDINGS) in a mode with one task per node would confine all of the
    node's processes to the first entry's cores: there torchrun's workers apply it themselves.
    """
    bind = preset.cpu_bind
    if bind and spec.mode != "per-gpu" and bind.startswith(PER_TASK_BINDINGS):
        return None
    return bind
