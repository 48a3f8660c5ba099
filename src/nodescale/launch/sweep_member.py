"""``nodescale sweep-member SWEEP_DIR -- COMMAND...``: run COMMAND as one member of a sweep.

An array job's script runs this in place of the command, on every rank and in every launch mode: it
reads the member's index (``NODESCALE_SWEEP_INDEX``, which the script sets, else Slurm's or PBS's array
index), looks the member up in ``SWEEP_DIR/sweep.json``, and becomes the member's command
(:func:`nodescale.launch.sweep.member_command`): ``exec``, so signals and the exit code are the command's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from nodescale.errors import EXIT_USER_ERROR, UserError, program_not_found
from nodescale.launch import sweep_manifest
from nodescale.launch.sweep import INDEX_VARIABLE, RESUME_VARIABLE, member_command

_INDEX_SOURCES = (INDEX_VARIABLE, "SLURM_ARRAY_TASK_ID", "PBS_ARRAY_INDEX")


def member_index(env: Mapping[str, str]) -> int:
    for name in _INDEX_SOURCES:
        text = env.get(name, "")
        if text.isdigit():
            return int(text)
    raise UserError("this sweep member", f"has no index: none of {', '.join(_INDEX_SOURCES)} is set",
                    "it runs inside the array job that `nodescale launch --sweep` submits")


def resolve(argv: list[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The member's argv and variables from this module's arguments and the job's environment."""
    if len(argv) < 3 or argv[1] != "--":
        raise UserError(f"sweep_member {' '.join(argv)!r}", "takes SWEEP_DIR -- COMMAND...")
    sweep = sweep_manifest.read(Path(argv[0]))
    index = member_index(env)
    member = next((member for member in sweep.members if member.index == index), None)
    if member is None:
        raise UserError(f"sweep member {index}", f"is not one of the {len(sweep.members)} members of {argv[0]}")
    return member_command(sweep, member, argv[2:], resume=env.get(RESUME_VARIABLE) == "1")


def main(argv: list[str]) -> int:
    try:
        command, env = resolve(argv, os.environ)
    except UserError as exc:
        print(f"nodescale: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, {**os.environ, **env})
    except FileNotFoundError:
        print(f"nodescale: error: {program_not_found(command[0])}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
