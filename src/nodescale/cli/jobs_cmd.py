"""``nodescale jobs``, ``nodescale cancel`` and ``nodescale clusters``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from nodescale.errors import UserError

if TYPE_CHECKING:
    from nodescale.launch.sweep_manifest import Sweep


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    jobs = subparsers.add_parser("jobs", help="the jobs nodescale submitted, with their scheduler state; "
                                 "a sweep is one line (its members done, running, pending, failed)")
    jobs.add_argument("sweep", nargs="?", type=Path, metavar="SWEEP_DIR",
                      help="a sweep's directory: one line per member (state, settings, run directory)")
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

    if args.sweep is not None:
        return show_sweep(args.sweep)
    jobs = submitted_jobs()
    single = [job for job in jobs if not job.sweep]
    states: dict[str, str] = {}
    for name in {job.scheduler for job in single}:
        states.update(BATCH[name].status([job.job_id for job in single if job.scheduler == name]))
    shown = 0
    for job in single:
        state = states.get(job.job_id)
        if state is None and not args.all:
            continue
        print(f"{job.job_id:<12} {job.scheduler:<6} {state or 'not queued':<12} {_when(job.submitted_at)}  "
              f"{job.name}  {job.log}")
        shown += 1
    shown += list_sweeps(list(dict.fromkeys(Path(job.sweep) for job in jobs if job.sweep)), args.all)
    if not shown:
        print("no queued or running jobs from nodescale" + ("" if args.all else " (--all shows finished ones)"))
    return 0


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))


def _sweep_line(sweep: Sweep, states: dict[int, str]) -> str:
    from nodescale.launch.sweep_state import counts

    newest = sweep.submissions[-1] if sweep.submissions else None
    found = counts(states)
    return (f"{newest.job_id if newest else '-':<12} {newest.scheduler if newest else '-':<6} {'sweep':<12} "
            f"{_when(newest.submitted_at) if newest else '-':<16}  {sweep.name}  {sweep.directory}  "
            f"{len(states)} members: " + ", ".join(f"{count} {state}" for state, count in found.items()))


def list_sweeps(directories: list[Path], show_all: bool) -> int:
    """One line per sweep whose members the scheduler still lists (every sweep with ``show_all``); how many."""
    from nodescale.launch import sweep_manifest, sweep_state

    sweeps, shown = [], 0
    for directory in directories:
        try:
            sweeps.append(sweep_manifest.read(directory))
        except UserError as exc:  # a sweep moved or deleted since: the others are still listed
            if show_all:
                print(f"{'-':<12} {'-':<6} {'sweep':<12} {'-':<16}  {directory}  (unreadable: {exc.rule})")
                shown += 1
    listed = sweep_state.query_queue(sweeps)
    for sweep in sweeps:
        if show_all or sweep_state.listed_states(sweep, listed):
            print(_sweep_line(sweep, sweep_state.member_states(sweep, listed)))
            shown += 1
    return shown


def show_sweep(directory: Path) -> int:
    """``nodescale jobs SWEEP_DIR``: the sweep's line, then one line per member."""
    from nodescale.launch import sweep_manifest, sweep_state

    sweep = sweep_manifest.read(directory)
    states = sweep_state.member_states(sweep, sweep_state.query_queue([sweep]))
    print(_sweep_line(sweep, states))
    for member in sweep.members:
        settings = " ".join(f"{key}={value}" for key, value in member.settings.items())
        print(f"  {member.index:>4}  {states[member.index]:<13} {settings}  {member.run_dir}")
    return 0


def cancel_job(args: argparse.Namespace) -> int:
    from nodescale.launch.job_log import find
    from nodescale.launch.schedulers.batch import ENDED
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
