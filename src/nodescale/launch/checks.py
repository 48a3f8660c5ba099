"""Job arithmetic checked before submission, with the numbers in the message.

A job that asks for more GPUs than a node has, starts two processes per GPU,
or runs past the queue's limit wastes a place in the queue and then fails (or
worse, runs slowly). :func:`check_job` refuses it first, showing the sum that
does not add up. Pure: no scheduler is asked, nothing is read from disk.
"""

from __future__ import annotations

import warnings

from nodescale.errors import UserError
from nodescale.launch.envcheck import EnvWarning, check_env
from nodescale.launch.restarts import check_restarts
from nodescale.launch.software import warn_without_container
from nodescale.launch.spec import JobSpec, Preset, walltime_seconds

# What a project/account looks like on each built-in cluster, for the hint when it is missing.
# (Preset has no field for it yet; a user preset's account falls back to the generic example.)
ACCOUNT_EXAMPLES = {
    "puhti": "project_XXXXXXX",
    "mahti": "project_XXXXXXX",
    "lumi": "project_XXXXXXXXX",
    "derecho": "PROJECTCODE",
}


def check_job(spec: JobSpec, preset: Preset) -> None:
    """Raise :class:`UserError` for a job ``preset``'s cluster would refuse, or run badly.

    Checked in the order a user would fix them: scheduler, GPUs, processes, CPUs,
    launch mode, account, wall time, then the merged environment (preset env
    overridden by the job's). Environment warnings are issued as :class:`EnvWarning`.
    """
    cluster = preset.name
    if spec.scheduler != "local" and spec.scheduler != preset.scheduler:
        raise UserError(f"--scheduler {spec.scheduler} --cluster {cluster}",
                        f"{cluster} runs {preset.scheduler}, not {spec.scheduler}",
                        f"drop --scheduler (the cluster decides) or use --scheduler {preset.scheduler}")

    gpus, nproc = spec.gpus_per_node, spec.nproc_per_node
    if gpus > preset.gpus_per_node:
        have = f"{preset.gpus_per_node} GPUs" if preset.gpus_per_node else "no GPUs"
        total = spec.nodes * gpus
        hint = (f"for {total} GPUs use --nodes {-(-total // preset.gpus_per_node)} --gpus-per-node "
                f"{preset.gpus_per_node}" if preset.gpus_per_node else "use --gpus-per-node 0 (CPU processes)")
        raise UserError(f"--gpus-per-node {gpus}", f"{cluster} nodes have {have}", hint)

    if gpus > 0 and nproc > gpus:
        raise UserError(f"--nproc-per-node {nproc} --gpus-per-node {gpus}",
                        f"{nproc} processes on {gpus} GPUs would share them "
                        f"({nproc} / {gpus} = {nproc / gpus:g} per GPU): slower, and NCCL refuses two ranks on one GPU",
                        f"one process per GPU: --nproc-per-node {gpus}")

    if spec.mode == "per-gpu" and nproc != gpus:
        rule = ("per-gpu mode starts one task per GPU, and this job has no GPUs" if gpus == 0 else
                f"per-gpu mode starts one task per GPU: {nproc} processes != {gpus} GPUs")
        hint = "use --mode torchrun for CPU processes" if gpus == 0 else f"use --nproc-per-node {gpus}"
        raise UserError(f"--mode per-gpu --nproc-per-node {nproc} --gpus-per-node {gpus}", rule, hint)

    # Whatever the launcher, nproc processes share the node's cores: per-gpu mode asks the scheduler
    # for nproc tasks, torchrun/spawn for one task whose workers split its cores.
    if preset.cpus_per_node // nproc < 1:
        raise UserError(f"--nproc-per-node {nproc}",
                        f"{cluster} nodes have {preset.cpus_per_node} cores: "
                        f"{preset.cpus_per_node} // {nproc} = 0 cores per process",
                        f"at most {preset.cpus_per_node} processes per node; add --nodes instead")

    if spec.mode == "spawn" and spec.nodes > 1:
        raise UserError(f"--mode spawn --nodes {spec.nodes}",
                        "spawn starts its processes on one node only; the other nodes would sit idle",
                        "use --mode torchrun (one launcher per node) or --mode per-gpu")

    if preset.account_required and not spec.account:
        example = ACCOUNT_EXAMPLES.get(cluster, "YOUR_PROJECT")
        raise UserError(f"--cluster {cluster}", f"{cluster} rejects jobs without --account",
                        f"--account {example} (the project the job is charged to)")

    queue = spec.queue or preset.queue
    # The limit is the preset queue's; another queue the user names may allow more (Puhti's longrun).
    if preset.max_time and queue == preset.queue:
        asked, limit = walltime_seconds(spec.time), walltime_seconds(preset.max_time)
        if asked > limit:
            where = f"{cluster}'s {queue} queue" if queue else cluster
            raise UserError(f"--time {spec.time}", f"{where} allows at most {preset.max_time} "
                            f"({asked / 3600:g} h > {limit / 3600:g} h)",
                            f"ask for --time {preset.max_time} or less; checkpoints let the next job resume")

    check_restarts(spec, preset)
    for warning in check_env({**preset.env, **spec.env}):
        warnings.warn(warning, EnvWarning, stacklevel=2)
    warn_without_container(spec, preset)
