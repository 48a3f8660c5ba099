"""A sweep's members as one array job: the lines the Slurm and PBS scripts add for it (pure text, no I/O).

Each Slurm array task, or PBS subjob, is one sweep member (:mod:`nodescale.launch.sweep`):

- the script exports the member's index as ``NODESCALE_SWEEP_INDEX``; the command runs under
  :mod:`nodescale.launch.sweep_member`, which reads it on every rank and applies the member's settings;
- a requeue targets the member (``ARRAYID_TASKID``), never the whole array
  (Lightning-AI/pytorch-lightning#15022);
- once the step has ended for good (not when it stops for a requeue) the script writes the member's
  exit code to ``SWEEP_DIR/status/INDEX`` (a temporary file, then ``mv``: readers never see half of it).

PBS's ``-J X-Y[:Z]`` takes one range with a step, at least two subjobs: a set of members that is not
one such range is submitted as several jobs (:func:`pbs_runs`), a single member as a plain job.
"""

from __future__ import annotations

from collections.abc import Sequence

from nodescale.launch import shell
from nodescale.launch.sweep import INDEX_VARIABLE
from nodescale.launch.sweep_manifest import STATUS_DIR

# The array member itself, as scontrol names it (SLURM_JOB_ID is the task's own id, not the member's name).
SLURM_MEMBER = '"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"'


def ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``: Slurm's ``--array`` list."""
    parts: list[str] = []
    start = previous = indices[0]
    for index in [*indices[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if index is not None:
            start = previous = index
    return ",".join(parts)


def step(indices: Sequence[int]) -> int | None:
    """The common difference of ``indices`` (at least two), or None where they are not one arithmetic range."""
    if len(indices) < 2:
        return None
    first = indices[1] - indices[0]
    same = all(b - a == first for a, b in zip(indices, indices[1:], strict=False))
    return first if same and first > 0 else None


def pbs_runs(indices: Sequence[int]) -> list[list[int]]:
    """``indices`` cut into arithmetic ranges (one ``-J`` each) and single members (a plain job each)."""
    runs: list[list[int]] = []
    for index in indices:
        run = runs[-1] if runs else []
        if len(run) == 1 or (len(run) > 1 and index - run[-1] == run[1] - run[0]):
            run.append(index)
        else:
            runs.append([index])
    return runs


def slurm_directives(indices: Sequence[int], max_concurrent: int | None) -> list[str]:
    return [f"--array={ranges(indices)}" + (f"%{max_concurrent}" if max_concurrent else "")]


def pbs_directives(indices: Sequence[int], max_concurrent: int | None) -> list[str]:
    """``-J`` (with ``-W max_run_subjobs`` for ``--max-concurrent``) and ``-r y``; nothing for one member."""
    if len(indices) == 1:
        return []
    difference = step(indices)
    if difference is None:
        raise ValueError(f"PBS -J takes one range with a step, not {list(indices)} (submit pbs_runs() apart)")
    span = f"{indices[0]}-{indices[-1]}" + (f":{difference}" if difference > 1 else "")
    # max_run_subjobs: PBS Professional 2020.1 / OpenPBS 20 and later. Arrays must be rerunnable (-r y).
    limit = [f"-W max_run_subjobs={max_concurrent}"] if max_concurrent else []
    return [f"-J {span}", *limit, "-r y"]


def index_lines(indices: Sequence[int], scheduler: str) -> list[str]:
    """Export the member's index: from the array's own variable, or the one member of a plain PBS job."""
    source = "$SLURM_ARRAY_TASK_ID" if scheduler == "slurm" else "$PBS_ARRAY_INDEX"
    if scheduler == "pbs" and len(indices) == 1:
        source = str(indices[0])
    return [
        "# Sweep member: `nodescale sweep-member` reads its index on every rank and applies its settings.",
        f"export {INDEX_VARIABLE}={source}",
    ]


def status_lines(sweep_dir: str) -> list[str]:
    """Write the member's exit code where ``nodescale jobs`` and ``launch --resubmit-failed`` read it."""
    directory = shell.quote(f"{sweep_dir.rstrip('/')}/{STATUS_DIR}/")
    return [
        "# The member ended for good (a requeue exited above): its exit code, written whole (temporary file, mv).",
        f'status_file={directory}"${INDEX_VARIABLE}"',
        'mkdir -p "${status_file%/*}" && echo "$step_status" > "$status_file.$$" && '
        'mv -f "$status_file.$$" "$status_file" || echo "nodescale: could not write $status_file"',
    ]


def slurm_requeue_said(member: bool) -> str:
    """What the script says it requeues: an array member as Slurm names it (``123_4``), else the job."""
    return "requeueing Slurm job " + (SLURM_MEMBER.strip('"') if member else "$SLURM_JOB_ID")


def slurm_requeue(command: str) -> str:
    """The requeue command with the array member as its target."""
    return command.replace('scontrol requeue "$SLURM_JOB_ID"', f"scontrol requeue {SLURM_MEMBER}")


def slurm_log_name(name: str) -> str:
    """``slurm-%j.out`` as ``slurm-%A_%a.out``: array id and member index."""
    return name.replace("%j", "%A_%a")


def slurm_log_words(job_dir: str) -> list[str]:
    """The member's .out and .err as shell words (for the failure summary)."""
    base = shell.quote(job_dir.rstrip("/") + "/") + 'slurm-"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"'
    return [f"{base}.out", f"{base}.err"]
