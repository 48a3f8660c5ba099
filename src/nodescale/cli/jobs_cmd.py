"""``nodescale jobs``, ``nodescale cancel`` and ``nodescale clusters``."""

from __future__ import annotations

import argparse
import time

from nodescale.errors import UserError

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "FINISHED"}


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    jobs = subparsers.add_parser("jobs", help="the jobs nodescale submitted, with their scheduler state")
    jobs.add_argument("--all", action="store_true", help="also jobs the scheduler no longer lists")
    jobs.set_defaults(handler=list_jobs)
    cancel = subparsers.add_parser("cancel", help="cancel a job nodescale submitted (scancel / qdel)")
    cancel.add_argument("job_id", help="the id `nodescale launch` printed")
    cancel.set_defaults(handler=cancel_job)
    clusters = subparsers.add_parser("clusters", help="list the cluster presets")
    clusters.set_defaults(handler=list_clusters)


def list_jobs(args: argparse.Namespace) -> int:
    from nodescale.launch.job_log import submitted_jobs
    from nodescale.launch.schedulers.table import BATCH

    jobs = submitted_jobs()
    states: dict[str, str] = {}
    for name in {job.scheduler for job in jobs}:
        states.update(BATCH[name].status([job.job_id for job in jobs if job.scheduler == name]))
    shown = 0
    for job in jobs:
        state = states.get(job.job_id)
        if state is None and not args.all:
            continue
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(job.submitted_at))
        print(f"{job.job_id:<12} {job.scheduler:<6} {state or 'not queued':<12} {when}  {job.name}  {job.log}")
        shown += 1
    if not shown:
        print("no queued or running jobs from nodescale" + ("" if args.all else " (--all shows finished ones)"))
    return 0


def cancel_job(args: argparse.Namespace) -> int:
    from nodescale.launch.job_log import find
    from nodescale.launch.schedulers.table import BATCH

    job = find(args.job_id)
    if job is None:
        raise UserError(f"job {args.job_id!r}", "was not submitted by nodescale on this account",
                        "`nodescale jobs --all` lists the jobs it knows; use scancel/qdel for others")
    scheduler = BATCH[job.scheduler]
    state = scheduler.status([job.job_id]).get(job.job_id)
    if state in ENDED:
        # scancel says nothing for an ended job; pretending to cancel it would mislead.
        raise UserError(f"job {job.job_id}", f"has already ended ({state})", f"its log: {job.log}")
    scheduler.cancel(job.job_id)
    print(f"cancelled {job.scheduler} job {job.job_id}")
    return 0


def list_clusters(args: argparse.Namespace) -> int:
    from nodescale.launch.presets import list_presets, load_preset

    for name in list_presets():
        try:
            preset = load_preset(name)
        except UserError as exc:  # one broken user file must not hide the other presets
            print(f"{name:<14} (unusable: {exc.rule})")
            continue
        print(f"{name:<14} {preset.scheduler:<6} {preset.gpus_per_node} GPUs x {preset.cpus_per_node} cores  "
              f"{preset.description}")
    return 0
