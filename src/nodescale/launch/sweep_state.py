"""Where a sweep's members stand now, for ``nodescale jobs`` and ``report``.

A member the scheduler lists as queued or running is in the scheduler's state; once it no longer
lists it (or lists it as ended), its state comes from the sweep's files
(:func:`nodescale.launch.sweep_manifest.member_state`): there may be no ``sacct`` to ask.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from nodescale.launch import sweep_manifest
from nodescale.launch.schedulers.batch import ENDED
from nodescale.launch.sweep_manifest import Submission, Sweep

# Scheduler states (Slurm's words; PBS's mapped to them) of a member whose processes run; other live ones wait.
RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "EXITING", "STAGE_OUT", "SIGNALING", "RESIZING"}
COUNTED = ("done", "running", "pending", "failed")
NOT_SUBMITTED = "not submitted"


def latest_submissions(sweep: Sweep) -> dict[int, Submission]:
    """Member index -> the newest submission that runs it (a --resubmit-failed one replaces the first)."""
    return {index: submission for submission in sweep.submissions for index in submission.members}


def query_queue(sweeps: Iterable[Sweep]) -> dict[str, str]:
    """The scheduler's listing of every array of ``sweeps`` (id as ``status`` gives it -> state): one
    status call per scheduler. Empty where the scheduler's commands are not installed."""
    from nodescale.launch.schedulers.table import BATCH

    job_ids: dict[str, set[str]] = {}
    for sweep in sweeps:
        for submission in sweep.submissions:
            if submission.scheduler in BATCH:  # "local" members have no queue to ask
                job_ids.setdefault(submission.scheduler, set()).add(submission.job_id)
    listed: dict[str, str] = {}
    for name, ids in job_ids.items():
        listed.update(BATCH[name].status(sorted(ids)))
    return listed


def listed_states(sweep: Sweep, listed: Mapping[str, str]) -> dict[int, str]:
    """Member index -> the scheduler's state, for the members ``listed`` (:func:`query_queue`) holds."""
    from nodescale.launch.schedulers.table import BATCH

    states = {}
    for index, submission in latest_submissions(sweep).items():
        scheduler = BATCH.get(submission.scheduler)
        if scheduler is None:
            continue
        state = listed.get(scheduler.member_id(submission.job_id, index))
        if state is None and len(submission.members) == 1:  # a lone PBS member goes as a plain job (-J needs two)
            state = listed.get(submission.job_id)
        if state is not None:
            states[index] = state
    return states


def member_states(sweep: Sweep, listed: Mapping[str, str]) -> dict[int, str]:
    """Member index -> ``done``, ``failed``, the scheduler's state in lower case (``running``, ``pending``,
    ``held``...), or ``not submitted``."""
    queue = listed_states(sweep, listed)
    submitted = latest_submissions(sweep)
    states = {}
    for member in sweep.members:
        state = queue.get(member.index)
        if state is not None and state not in ENDED:
            # Queued or running (again, after --resubmit-failed): an exit code of an earlier run is stale.
            states[member.index] = state.lower()
            continue
        states[member.index] = sweep_manifest.member_state(sweep, member)
        if states[member.index] == "failed" and member.index not in submitted and \
                sweep_manifest.exit_code(sweep.directory, member.index) is None:
            states[member.index] = NOT_SUBMITTED
    return states


def bucket(state: str) -> str:
    """Which of :data:`COUNTED` a member state counts as (held, requeued, not submitted: pending)."""
    if state in ("done", "failed"):
        return state
    return "running" if state.upper() in RUNNING else "pending"


def counts(states: Mapping[int, str]) -> dict[str, int]:
    """How many members are done, running, pending and failed."""
    found = dict.fromkeys(COUNTED, 0)
    for state in states.values():
        found[bucket(state)] += 1
    return found
