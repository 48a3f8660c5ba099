"""``launch``'s scheduler-option and software flags: their parser arguments, and the checked values.

``--mem``, ``--constraint``, ... become :class:`SchedulerOptions`; ``--module``, ``--setup`` (in the order
typed), ``--container``, ... and the submitting Python environment become :class:`Software`. A value the models
refuse is a :class:`UserError` naming the flag.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from nodescale.errors import UserError

# flag -> (help, example); repeatable flags take action="append".
SCHEDULER_FLAGS = {
    "--mem": ("memory per node, Slurm's form: 16G, 500M; 0 is all of it (Slurm)", "--mem 64G"),
    "--constraint": ("node features (Slurm --constraint; PBS has none)", "--constraint a100"),
    "--exclude": ("nodes not to use (Slurm; PBS cannot exclude)", "--exclude node[01-02],node7"),
    "--nodelist": ("nodes to run on (PBS: host= chunks)", "--nodelist node1,node2"),
    "--qos": ("quality of service (Slurm; PBS has none)", "--qos high"),
    "--reservation": ("reservation to run in (PBS: its queue)", "--reservation R123456"),
    "--dependency": ("start after other jobs: afterok:ID[:ID], afterany:ID, ... (PBS: -W depend)",
                     "--dependency afterok:4815162"),
    "--mail-type": ("mail on these events: BEGIN, END, FAIL, ALL, ... (Slurm's names; PBS: -m)",
                    "--mail-type END,FAIL"),
    "--mail-user": ("who gets the mail", "--mail-user alice@example.org"),
    "--cpus-per-task": ("CPUs per task, over the preset's rule (PBS: ncpus per node = this x tasks)",
                        "--cpus-per-task 8"),
}
REPEATABLE = {
    "--directive": ("a raw #SBATCH/#PBS option without the prefix, written with '=' (--directive=--exclusive; "
                    "repeatable)", "--directive=--gres=nvme:1"),
    "--module": ("module loaded after the preset's, in order with --setup (repeatable)", "--module cuda/12.2"),
    "--setup": ("shell line run after the preset's setup, in order with --module (repeatable)",
                "--setup 'export TMPDIR=/scratch/$USER'"),
    "--container-setup": ("shell line run inside the container before the command, after the preset's container "
                          "setup (repeatable)", "--container-setup 'source /project/venv/bin/activate'"),
    "--container-bind": ("bind mount SRC[:DST] for the container (repeatable)", "--container-bind /scratch"),
}
SOFTWARE_FLAGS = {"--container": ("Apptainer/Singularity image the job runs in, over the preset's",
                                  "--container /appl/pytorch.sif")}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The flags, in two help groups."""
    group = parser.add_argument_group("scheduler options (win over the preset's directives)")
    for flag, (text, _) in SCHEDULER_FLAGS.items():
        group.add_argument(flag, help=text)
    group.add_argument("--exclude-from", metavar="FILE", help="leave out the nodes in FILE: the bad-nodes.txt that "
                       "nodescale doctor or bench comm --pairs wrote under --out (Slurm --exclude; PBS cannot exclude)")
    group.add_argument("--directive", action="append", default=[], help=REPEATABLE["--directive"][0])
    group = parser.add_argument_group("software environment (added to the preset's)")
    for flag, metavar in (("--module", "MODULE"), ("--setup", "LINE")):
        # One list for both, each entry tagged with its flag: the script keeps the order they were typed in.
        group.add_argument(flag, action="append", default=[], dest="software_lines", metavar=metavar,
                           type=lambda value, kind=flag[2:]: (kind, value), help=REPEATABLE[flag][0])
    group.add_argument("--container", help=SOFTWARE_FLAGS["--container"][0])
    group.add_argument("--container-bind", action="append", default=[], help=REPEATABLE["--container-bind"][0])
    group.add_argument("--container-setup", action="append", default=[], metavar="LINE",
                       help=REPEATABLE["--container-setup"][0])


def _checked(model: Any, values: dict[str, Any], flags: dict[str, str]) -> Any:
    from pydantic import ValidationError

    try:
        return model(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        field, given = str(error["loc"][0]), error.get("input")
        if field == "lines" and isinstance(given, tuple):  # one Software.lines entry, (flag, value): name that flag
            flag, given = f"--{given[0]}", given[1]
        else:
            flag = flags.get(field, field)
        shown = ", ".join(map(repr, given)) if isinstance(given, list) else repr(given)
        example = {**SCHEDULER_FLAGS, **REPEATABLE, **SOFTWARE_FLAGS}.get(flag, ("", ""))[1]
        raise UserError(f"{flag} {shown}", error["msg"].removeprefix("Value error, "),
                        f"e.g. {example}" if example else None) from None


def scheduler_options(args: argparse.Namespace, scheduler: str = "slurm") -> Any:
    """The checked :class:`SchedulerOptions` of the flags."""
    from nodescale.launch.job_options import SchedulerOptions

    cpus = args.cpus_per_task
    if cpus is not None and not (cpus.strip().isdigit() and int(cpus) >= 1):
        raise UserError(f"--cpus-per-task {cpus}", "must be a whole number, at least 1", "e.g. --cpus-per-task 8")
    values = {"mem": args.mem, "constraint": args.constraint,
              "exclude": ([args.exclude] if args.exclude else []) + _excluded_from(args.exclude_from, scheduler),
              "nodelist": [args.nodelist] if args.nodelist else [], "qos": args.qos, "reservation": args.reservation,
              "dependency": args.dependency, "mail_type": [args.mail_type] if args.mail_type else [],
              "mail_user": args.mail_user, "directives": args.directive,
              "cpus_per_task": int(cpus) if cpus is not None else None}
    flags = {name: f"--{name.replace('_', '-')}" for name in values} | {"directives": "--directive"}
    return _checked(SchedulerOptions, values, flags)


def software(args: argparse.Namespace, scheduler: str) -> Any:
    """The checked :class:`Software` of the flags, with the submitting Python environment for a cluster job."""
    from nodescale.launch.job_options import Software
    from nodescale.launch.software import submitting_python_env

    named = [(f"--{kind}", value) for kind, value in args.software_lines]
    named += [("--container", image) for image in [args.container] if image is not None]
    named += [("--container-bind", bind) for bind in args.container_bind]
    named += [("--container-setup", line) for line in args.container_setup]
    if scheduler == "local" and named:
        raise UserError(f"{named[0][0]} {shlex.quote(named[0][1])} with a local run", "sets up a Slurm or PBS job "
                        "script's environment", "run it here in the environment you want, or submit with "
                        "--cluster/--scheduler")
    given = {"lines": args.software_lines, "container": args.container, "container_binds": args.container_bind,
             "container_setup": args.container_setup,
             "python_env": submitting_python_env() if scheduler != "local" else None}
    flags = {"container": "--container", "container_binds": "--container-bind", "container_setup": "--container-setup"}
    return _checked(Software, given, flags)


def _excluded_from(path: str | None, scheduler: str) -> list[str]:
    """The hosts of ``--exclude-from FILE``, named on stderr with the reasons the file gives."""
    if path is None:
        return []
    from pathlib import Path

    from nodescale.bad_nodes import read

    found = read(Path(path))
    if found and scheduler == "pbs":
        raise UserError(f"--exclude-from {path} ({', '.join(found)})", "PBS Pro cannot leave named hosts out of a "
                        "job (qsub has no exclude list)", "ask the site's admins to offline the node (pbsnodes -o), "
                        "or list the hosts to run on with --nodelist")
    for host, reason in found.items() if scheduler != "local" else ():  # a local run ignores --exclude too
        print(f"nodescale: leaving node {host} out (--exclude-from {path}){': ' + reason if reason else ''}",
              file=sys.stderr)
    return [",".join(found)] if found else []
