"""The command line's scheduler options as ``#SBATCH`` and ``#PBS`` lines, winning over the preset's.

A preset's directive that sets what the user set on the command line (``--mem=0`` against
``--mem 64G``, ``-C`` against ``--constraint``) is left out rather than written twice. Where
PBS Pro has no equivalent (Slurm's QOS, node exclusion and features), the option is refused
with :class:`UserError` naming the missing feature. PBS sources: qsub(1B) (``-m``, ``-M``,
``-W depend``, ``-q`` for a reservation's queue) and pbs_resources(7B) (``host`` and ``mem``
inside a ``select`` chunk) of openpbs/openpbs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from nodescale.errors import UserError
from nodescale.launch import shell
from nodescale.launch.job_options import SchedulerOptions, hosts
from nodescale.launch.spec import JobSpec, Preset

# sbatch's one-letter options that have a long form users may also write.
_SLURM_SHORT = {"-c": "--cpus-per-task", "-C": "--constraint", "-x": "--exclude", "-w": "--nodelist",
                "-q": "--qos", "-d": "--dependency", "-p": "--partition", "-A": "--account", "-t": "--time"}
# sbatch(1): --mem, --mem-per-cpu and --mem-per-gpu are mutually exclusive: one replaces another.
_SLURM_SAME = {"--mem-per-cpu": "--mem", "--mem-per-gpu": "--mem"}
# qsub's -m letters for Slurm's mail types; the others have no PBS event.
_PBS_MAIL = {"NONE": "n", "BEGIN": "b", "END": "e", "FAIL": "a", "ALL": "abe", "ARRAY_TASKS": "j"}
_PBS_DEPENDENCY = ("after", "afterok", "afternotok", "afterany")
_PBS_SIZE = {"": "mb", "K": "kb", "M": "mb", "G": "gb", "T": "tb"}  # Slurm's default unit is MB


def slurm_key(line: str) -> str:
    """The option an ``#SBATCH`` line sets, in its long form: ``-w a`` and ``--nodelist=a`` -> ``--nodelist``."""
    text = line.strip()
    key = re.split(r"[=\s]", text, maxsplit=1)[0] if text.startswith("--") else text[:2]
    key = _SLURM_SHORT.get(key, key)
    return _SLURM_SAME.get(key, key)


def pbs_key(line: str) -> str:
    """The option a ``#PBS`` line sets: ``-l place=x`` -> ``-l place``, ``-W depend=..`` -> ``-W depend``."""
    words = line.split(maxsplit=1)
    if not words:
        return ""
    if words[0] in ("-l", "-W") and len(words) > 1:
        return f"{words[0]} {re.split(r'[=,]', words[1], maxsplit=1)[0]}"
    return words[0][:2]


def slurm_lines(spec: JobSpec, preset: Preset, word: Callable[[str, str], str]) -> list[str]:
    """The preset's directives the command line leaves standing, then the command line's (values through ``word``)."""
    options = spec.options
    lines = []
    for flag, value in (("--mem", options.mem), ("--constraint", options.constraint),
                        ("--exclude", ",".join(options.exclude)), ("--nodelist", ",".join(options.nodelist)),
                        ("--qos", options.qos), ("--reservation", options.reservation),
                        ("--dependency", options.dependency), ("--mail-type", ",".join(options.mail_type)),
                        ("--mail-user", options.mail_user)):
        if value:
            lines.append(f"{flag}={word(value, flag)}")
    if options.dependency and re.search(r"\.|\[", options.dependency):
        raise UserError(f"--dependency {options.dependency}", "Slurm job ids are numbers (123, or 123_4 for an array "
                        "task)", "the id sbatch printed, e.g. --dependency afterok:4815162")
    _check_nodes(spec)
    return _merge(preset.directives, lines, options, slurm_key, {"--cpus-per-task"} if options.cpus_per_task else set())


def pbs_lines(spec: JobSpec, preset: Preset) -> list[str]:
    """Like :func:`slurm_lines`, for ``#PBS``; :class:`UserError` for what PBS Pro cannot ask for."""
    options = spec.options
    _pbs_unsupported(options)
    lines = []
    if options.dependency:
        lines.append(f"-W depend={_pbs_dependency(options.dependency)}")
    if options.mail_type:
        lines.append(f"-m {_pbs_mail(options.mail_type)}")
    if options.mail_user:
        lines.append(f"-M {options.mail_user}")
    return _merge(preset.directives, lines, options, pbs_key, set())


def pbs_queue(spec: JobSpec, preset: Preset) -> str | None:
    """The queue to submit to: a reservation's (PBS runs a reservation's jobs from its own queue), or the job's."""
    reservation = spec.options.reservation
    if reservation and spec.queue:
        raise UserError(f"--reservation {reservation} with --queue {spec.queue}",
                        "a PBS reservation is a queue of its own: the job goes to one or the other",
                        "drop --queue (the reservation's queue is used)")
    if reservation and "," in reservation:
        raise UserError(f"--reservation {reservation}", "PBS submits a job to one reservation's queue",
                        "name one reservation (its queue, e.g. R123456)")
    return reservation or spec.queue or preset.queue


def pbs_select(spec: JobSpec, chunk: str) -> str:
    """The ``select`` value: ``chunk`` per node with the memory asked for, one chunk per ``--nodelist`` host."""
    if spec.options.mem:
        chunk += f":mem={_pbs_size(spec.options.mem)}"
    listed = _check_nodes(spec)
    for name in listed:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise UserError(f"--nodelist {name}", "cannot be a PBS host name", "list the hosts by name")
    parts = [f"1:host={name}:{chunk}" for name in listed]
    if spec.nodes > len(listed):
        parts.append(f"{spec.nodes - len(listed)}:{chunk}")
    return "+".join(parts)


def _merge(preset_lines: Sequence[str], lines: list[str], options: SchedulerOptions, key: Callable[[str], str],
           also_set: set[str]) -> list[str]:
    """Preset lines not overridden, then ``lines``, then the raw ``--directive`` lines."""
    raw = [shell.check_line(line, "--directive") for line in options.directives]
    set_by_flags = {key(line) for line in lines}
    for line in raw:
        if key(line) in set_by_flags:
            raise UserError(f"--directive {line!r}", f"sets {key(line)}, which another flag of this command also sets",
                            "give it once: with its own flag, or with --directive")
    overridden = set_by_flags | {key(line) for line in raw} | also_set
    kept = [shell.check_line(line, "preset directive") for line in preset_lines if key(line) not in overridden]
    return [*kept, *lines, *raw]


def _check_nodes(spec: JobSpec) -> list[str]:
    listed, excluded = hosts(spec.options.nodelist), hosts(spec.options.exclude)
    if len(listed) > spec.nodes:
        raise UserError(f"--nodelist {','.join(spec.options.nodelist)}",
                        f"names {len(listed)} nodes and the job has {spec.nodes}", f"use --nodes {len(listed)}")
    both = sorted(set(listed) & set(excluded))
    if both:
        raise UserError(f"--nodelist and --exclude {','.join(both)}", "a node cannot be both required and excluded",
                        "drop it from one of them")
    return listed


def _pbs_unsupported(options: SchedulerOptions) -> None:
    missing = [
        (options.qos, "--qos", "quality of service", "PBS Pro has no QOS; sites give priority through queues or "
         "resources: use --queue, or --directive with your site's (NCAR: --directive='-l job_priority=premium')"),
        (options.exclude, "--exclude", "node exclusion", "list the nodes to run on with --nodelist instead"),
        (options.constraint, "--constraint", "node features", "sites select node types with a custom resource: give "
         "it with --directive (ask your site which, e.g. --directive='-l gpu_type=a100')"),
    ]
    for value, flag, feature, hint in missing:
        if value:
            shown = ",".join(value) if isinstance(value, list) else value
            raise UserError(f"{flag} {shown}", f"PBS Pro has no {feature}", hint)
    if options.mem_mb == 0:
        raise UserError(f"--mem {options.mem}", "PBS Pro has no 'all of the node's memory' request (Slurm's --mem=0)",
                        "give the amount, e.g. --mem 200G, or leave --mem out (the queue's default)")


def _pbs_size(mem: str) -> str:
    number, unit = re.fullmatch(r"(\d+)([KMGT]?)", mem).groups()  # type: ignore[union-attr]
    return f"{number}{_PBS_SIZE[unit]}"


def _pbs_mail(types: list[str]) -> str:
    missing = [name for name in types if name not in _PBS_MAIL]
    if missing:
        raise UserError(f"--mail-type {','.join(types)}", f"PBS Pro mails at no {', '.join(missing)} event: only at "
                        "the start, the end and an abort", "use BEGIN, END, FAIL, ALL, NONE (ARRAY_TASKS with them)")
    letters = "".join(_PBS_MAIL[name] for name in types)
    if "n" in letters and len(types) > 1:
        raise UserError(f"--mail-type {','.join(types)}", "NONE cannot go with other mail types", "drop NONE")
    if letters == "j":
        raise UserError("--mail-type ARRAY_TASKS", "PBS Pro mails about array tasks only with BEGIN, END or FAIL",
                        "e.g. --mail-type ARRAY_TASKS,END")
    # qsub(1B): n, or [j] and one or more of a, b, e.
    return "".join(letter for letter in "jabe" if letter in letters) or "n"


def _pbs_dependency(dependency: str) -> str:
    unsupported = (dependency == "singleton" and "singleton"
                   or "?" in dependency and "'?' (any of the conditions)"
                   or re.search(r"(^|[,?])(aftercorr|afterburstbuffer):", dependency) and "aftercorr, afterburstbuffer"
                   or re.search(r"[_+]", dependency) and "array task ids (_N) and delays (+minutes)")
    if unsupported:
        raise UserError(f"--dependency {dependency}", f"PBS Pro has no {unsupported} dependency",
                        f"use {', '.join(_PBS_DEPENDENCY)} with job ids, joined by ',' (all must hold)")
    return dependency
