"""``nodescale launch``: build the job from the flags, then print its dry run or submit it.

Each scheduler (:mod:`nodescale.launch.schedulers`) turns the job into a dry run, which
``--dry-run`` prints and a launch submits: the same path, stopped before the one call that
submits.
"""

from __future__ import annotations

import argparse
import re
import warnings
from pathlib import Path
from typing import Any

from nodescale.cli import launch_flags, launch_sweep
from nodescale.errors import UserError
from nodescale.launch.stop_handler import DEFAULT_MAX_REQUEUES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run a command on this machine, or submit it to Slurm or PBS Pro on N nodes",
        description="Write a correct job script for COMMAND (nodescale train ..., python my_script.py ..., "
        "or any program) and run it locally or submit it. Everything after -- is the command.",
    )
    parser.add_argument("--scheduler", help="local, slurm or pbs (default: the cluster preset's, else local)")
    parser.add_argument("--cluster", metavar="PRESET", help="cluster preset (see `nodescale clusters`)")
    parser.add_argument("--nodes", default="1", help="number of nodes")
    parser.add_argument("--gpus-per-node", help="GPUs per node to request (default: the preset's)")
    parser.add_argument("--nproc-per-node", help="processes per node (default: GPUs per node, else 1)")
    parser.add_argument("--mode", default="torchrun",
                        help="torchrun (one launcher per node, default), per-gpu (one task per GPU with "
                        "RANK/LOCAL_RANK/WORLD_SIZE exported), spawn (the command once; it starts its processes)")
    parser.add_argument("--time", default="01:00:00", help="wall time HH:MM:SS")
    parser.add_argument("--account", help="account / project to charge")
    parser.add_argument("--queue", help="partition (Slurm) or queue (PBS)")
    parser.add_argument("--job-name", default=None, help="job name (default: nodescale)")
    parser.add_argument("--job-dir", default="nodescale-jobs", help="where scripts and logs are written")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the job (repeatable; checked for NCCL/FI typos)")
    parser.add_argument("--dry-run", action="store_true", help="print the script and the submit command only")
    parser.add_argument("--plan", action="store_true", help="first print `nodescale plan` of the nodescale train "
                        "command on these nodes, and warn when --time is shorter than it estimates")
    parser.add_argument("--stop-warning", metavar="SECONDS", default=None,
                        help="Slurm/PBS: signal the ranks this long before the wall time, so they checkpoint and "
                             "the job is requeued (default 120)")
    parser.add_argument("--stop-handler", metavar="WHO", default=None,
                        help="Slurm/PBS: who acts on the stop signal before the wall time: nodescale (its ranks "
                        "checkpoint, the job is requeued), framework (Lightning requeues itself), none (no signal; "
                        "the job runs to its wall time). Default: decided from the command, and said")
    parser.add_argument("--max-requeues", metavar="N", default=None,
                        help=f"Slurm/PBS: requeue the job at most N times (default {DEFAULT_MAX_REQUEUES})")
    parser.add_argument("--no-requeue", dest="requeue", action="store_false",
                        help="Slurm/PBS: no stop signal before the wall time and no requeue (--stop-handler none)")
    launch_flags.add_flags(parser)
    launch_sweep.add_flags(parser)
    parser.add_argument("--max-restarts", metavar="N", default=None,
                        help="run the job's processes again after a failure, up to N times (not after a user "
                             "error); `nodescale train` resumes from its newest checkpoint: give train --out DIR "
                             "and --checkpoint-every K after --")
    parser.add_argument("--spare-nodes", metavar="K", default=None,
                        help="Slurm: ask for K more nodes; a restart runs on them instead of a failed node")
    for flag in TRAIN_FLAGS:  # train's flags, given to launch by mistake: say where they go
        parser.add_argument(flag, dest=f"misplaced_{flag[2:].replace('-', '_')}", nargs="?", const="",
                            default=None, help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    parser.set_defaults(handler=run)


DEFAULT_STOP_WARNING_S = 120
# Checkpoint flags of `nodescale train`, which launch refuses with the place they belong.
TRAIN_FLAGS = ("--checkpoint-every", "--resume", "--out", "--keep-last")


def _count(flag: str, text: str | list[str] | None, minimum: int = 1) -> int | None:
    if text is None:
        return None
    if isinstance(text, list):  # Python 3.11's argparse turns "--nodes=--" into []
        text = " ".join(text) or "--"
    if not text.strip().isdigit() or int(text) < minimum:
        raise UserError(f"{flag} {text}", f"must be a whole number, at least {minimum}", f"e.g. {flag} 2")
    return int(text)


def _env_pairs(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise UserError(f"--env {item!r}", "must look like KEY=VALUE with a shell variable name as KEY",
                            "e.g. --env NCCL_DEBUG=INFO")
        pairs[key] = value
    return pairs


def build_spec(args: argparse.Namespace) -> tuple[Any, Any]:
    """The ``JobSpec`` and ``Preset`` (``None`` for local runs) from the flags, checked as far as the flags
    go (the scheduler's dry run checks the job against the cluster)."""
    from pydantic import ValidationError

    from nodescale.launch.schedulers.table import BATCH, SCHEDULERS
    from nodescale.launch.spec import JobSpec, walltime_seconds

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UserError("launch without a command", "needs the program to run after --",
                        "e.g. nodescale launch --nodes 2 -- nodescale train")
    scheduler = args.scheduler
    if scheduler is not None and scheduler not in SCHEDULERS:
        from nodescale.errors import unknown_choice

        raise unknown_choice("scheduler", scheduler, SCHEDULERS)
    preset = None
    if scheduler == "local" and args.cluster:
        raise UserError(f"--cluster {args.cluster} with --scheduler local",
                        "a cluster preset describes a scheduler's jobs, not this machine",
                        "drop --cluster to run here, or drop --scheduler local to submit to the cluster")
    if args.cluster or scheduler in BATCH:
        from nodescale.launch.presets import load_preset

        preset = load_preset(args.cluster or BATCH[str(scheduler)].default_preset)
        scheduler = scheduler or preset.scheduler
    scheduler = scheduler or "local"
    _refuse_misplaced_flags(args, command, scheduler)
    gpus = _count("--gpus-per-node", args.gpus_per_node, minimum=0)
    if gpus is None:
        gpus = preset.gpus_per_node if preset is not None else _local_gpus()
    nproc = _count("--nproc-per-node", args.nproc_per_node) or max(gpus, 1)
    workdir = Path.cwd()
    try:
        spec = JobSpec(
            scheduler=scheduler,
            preset=preset.name if preset is not None else "local",
            nodes=_count("--nodes", args.nodes),
            gpus_per_node=gpus,
            nproc_per_node=nproc,
            mode=args.mode,
            time=args.time,
            account=args.account,
            queue=args.queue,
            job_name=args.job_name or "nodescale",
            env=_env_pairs(args.env),
            command=command,
            stop_handler=_stop_handler(args, command, scheduler, workdir).handler,
            max_requeues=(DEFAULT_MAX_REQUEUES if args.max_requeues is None
                          else _count("--max-requeues", args.max_requeues, minimum=0)),
            stop_warning_s=(DEFAULT_STOP_WARNING_S if args.stop_warning is None
                            else _count("--stop-warning", args.stop_warning, minimum=0)),
            max_restarts=_count("--max-restarts", args.max_restarts, minimum=0) or 0,
            spare_nodes=_count("--spare-nodes", args.spare_nodes, minimum=0) or 0,
            workdir=workdir,
            job_dir=(workdir / args.job_dir).resolve(),
            options=launch_flags.scheduler_options(args, scheduler),
            software=launch_flags.software(args, scheduler),
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "job"
        raise UserError(f"--{field.replace('_', '-')} {error.get('input')!r}", error["msg"].removeprefix(
            "Value error, "), "see `nodescale launch --help`") from None
    wall = walltime_seconds(spec.time)
    too_late = spec.requeue and scheduler != "local" and spec.stop_warning_s >= wall
    if too_late and args.stop_warning is None:
        # A short test job with the default lead: signalled at once, it would requeue forever.
        warnings.warn(f"no stop signal and no requeue: the wall time {spec.time} is not longer than the default "
                      f"{DEFAULT_STOP_WARNING_S} s stop warning (set --stop-warning to keep them)", stacklevel=2)
        spec = spec.model_copy(update={"stop_handler": "none"})
    elif too_late:
        raise UserError(f"--stop-warning {spec.stop_warning_s} with --time {spec.time}",
                        f"the stop signal must come before the wall time ends, and {spec.stop_warning_s} s "
                        f"is not less than {wall} s",
                        "use a shorter --stop-warning (the time one checkpoint takes, plus a margin), a longer "
                        "--time, or --stop-handler none")
    if spec.mode == "spawn" and command[:2] == ["nodescale", "train"] and spec.nproc_per_node > 1:
        # Under a one-task launcher nodescale train is that one process; it spawns nothing.
        raise UserError("--mode spawn with nodescale train",
                        f"would run 1 process, not {spec.nproc_per_node}",
                        "use --mode torchrun (the default) or --mode per-gpu")
    return spec, preset


def _stop_handler(args: argparse.Namespace, command: list[str], scheduler: str, workdir: Path) -> Any:
    """Who acts on the stop signal: ``--stop-handler``, ``--no-requeue`` (none), or what the command shows."""
    from nodescale.launch.stop_handler import Decision, decide

    if not args.requeue:
        if args.stop_handler not in (None, "none"):
            raise UserError(f"--no-requeue with --stop-handler {args.stop_handler}", "--no-requeue means "
                            "--stop-handler none", "keep one of them")
        return Decision("none", "--no-requeue")
    return decide(command, args.stop_handler, scheduler, args.mode, workdir)


def say_stop_handler(args: argparse.Namespace, spec: Any) -> None:
    """The one line that says what happens to a cluster job at its wall time, on stderr (nothing for local runs)."""
    import sys

    from nodescale.launch.stop_handler import Decision, sentence

    if spec.scheduler == "local":
        return
    decision = _stop_handler(args, spec.command, spec.scheduler, spec.workdir)
    if decision.handler != spec.stop_handler:  # a wall time too short for the stop warning
        decision = Decision(spec.stop_handler, f"--time {spec.time}")
    print(sentence(decision, spec.stop_warning_s, spec.max_requeues), file=sys.stderr, flush=True)


def _refuse_misplaced_flags(args: argparse.Namespace, command: list[str], scheduler: str) -> None:
    """launch takes --max-restarts; `nodescale train` takes the checkpoint flags: say so for a misplaced one."""
    for flag in TRAIN_FLAGS:
        if getattr(args, f"misplaced_{flag[2:].replace('-', '_')}") is not None:
            raise UserError(f"nodescale launch {flag}", "is a flag of `nodescale train`, not of launch",
                            f"put it after --: nodescale launch --max-restarts 2 -- nodescale train {flag} ...")
    train_restarts = any(word.split("=")[0] == "--max-restarts" for word in command[2:])
    if scheduler != "local" and command[:2] == ["nodescale", "train"] and train_restarts:
        raise UserError(f"nodescale train --max-restarts in a {scheduler} job",
                        "restarts belong to the launcher: the job restarts the processes, not train",
                        "give --max-restarts to launch, before --: nodescale launch --max-restarts 2 -- "
                        "nodescale train --out DIR --checkpoint-every K")


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(args: argparse.Namespace) -> int:
    """Print the job's dry run (``--dry-run``), or submit it: the same dry run."""
    from nodescale.launch.schedulers.allocation import step_scheduler
    from nodescale.launch.schedulers.table import BATCH, SCHEDULERS

    if launch_sweep.wanted(args):
        if args.plan:
            raise UserError("--plan with --sweep", "plans one training command, and a sweep runs several",
                            "plan one member: nodescale plan --cluster C --nodes N ... with its train flags")
        return launch_sweep.run(args)
    spec, preset = build_spec(args)
    # Inside an allocation this shell holds (salloc, qsub -I), a step there rather than a new job.
    scheduler = (spec.scheduler in BATCH and step_scheduler(BATCH[spec.scheduler])) or SCHEDULERS[spec.scheduler]
    dryrun = scheduler.dryrun(spec, preset)
    if scheduler is SCHEDULERS[spec.scheduler]:  # a step in an allocation is not requeued
        say_stop_handler(args, spec)
    if args.plan:  # after the job is checked, before it is shown or submitted
        from nodescale.cli.plan_cmd import plan_launch

        plan_launch(spec, preset)
    if args.dry_run:
        print(dryrun.show(), end="")
        return 0
    return scheduler.submit(dryrun)
