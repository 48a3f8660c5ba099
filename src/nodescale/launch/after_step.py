"""A command the batch shell runs once the job's step has ended for good (pure text, no I/O).

A scaling study's job (:mod:`nodescale.bench.scaling_study`) gathers the study's results here, whatever
the step's exit code, so the results are there as each job ends. It runs before the script's last line
(``exit "$step_status"``): not when the ranks stopped for a requeue (the requeued job runs it later),
and its own failure leaves the job's exit code alone. In the preset's container, where nodescale may
exist only inside it.
"""

from __future__ import annotations

from nodescale.launch import shell, startup
from nodescale.launch.spec import Container

EXIT_LINE = 'exit "$step_status"'


def lines(command: list[str], container: Container | None) -> list[str]:
    """Run ``command`` (each word quoted) in the batch shell; say so if it fails, and go on."""
    for word in command:
        shell.check_line(word, "after-step command word")
    run = startup.launch_command([], container, None, "nodescale-after-step", command)
    return [
        "# The step has ended for good: gather its results now (a failure here leaves the job's exit code alone).",
        *run[:-1], f"{run[-1]} || echo {shell.quote(f'nodescale: {shell.join(command)} failed; run it again by hand')}",
    ]


def before_exit(blocks: list[list[str]], command: list[str], container: Container | None) -> list[list[str]]:
    """The run blocks, ``command`` run just before their last line; unchanged without a command."""
    if not command:
        return blocks
    *head, last = blocks
    assert last[-1] == EXIT_LINE, "the run blocks end in the step's exit"
    return [*head, [*last[:-1], *lines(command, container), last[-1]]]
