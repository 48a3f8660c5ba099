"""Lines the batch shell runs once the job's step has ended for good (pure text, no I/O).

They go just before the script's last line (``exit "$step_status"``): not when the ranks stopped for a
requeue (the requeued job runs them later), and their own failure leaves the job's exit code alone. A
sweep member writes its exit code there (:func:`nodescale.launch.job_array.status_lines`); a scaling
study's job gathers the study's results (:mod:`nodescale.bench.scaling_study`), whatever the step's exit
code, in the preset's container, where nodescale may exist only inside it.
"""

from __future__ import annotations

from nodescale.launch import job_array, shell, startup
from nodescale.launch.spec import Container, JobSpec, Preset

EXIT_LINE = 'exit "$step_status"'


def lines(command: list[str], container: Container | None) -> list[str]:
    """Run ``command`` (each word quoted) in the batch shell; say so if it fails, and go on. None without one."""
    if not command:
        return []
    for word in command:
        shell.check_line(word, "after-step command word")
    run = startup.launch_command([], container, None, "nodescale-after-step", command)
    return [
        "# The step has ended for good: gather its results now (a failure here leaves the job's exit code alone).",
        *run[:-1], f"{run[-1]} || echo {shell.quote(f'nodescale: {shell.join(command)} failed; run it again by hand')}",
    ]


def ended_lines(spec: JobSpec, preset: Preset) -> list[str]:
    """What this job runs once its step has ended: a sweep member's status, then the study's gathering."""
    status = job_array.status_lines(str(spec.array.sweep_dir)) if spec.array else []
    return [*status, *lines(spec.after_step, preset.container)]


def before_exit(blocks: list[list[str]], extra: list[str]) -> list[list[str]]:
    """The run blocks, ``extra`` just before their last line; unchanged without lines."""
    if not extra:
        return blocks
    *head, last = blocks
    assert last[-1] == EXIT_LINE, "the run blocks end in the step's exit"
    return [*head, [*last[:-1], *extra, last[-1]]]
