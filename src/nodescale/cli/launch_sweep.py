"""``nodescale launch --sweep KEY=V1,V2 ... -- COMMAND`` and ``nodescale launch --resubmit-failed SWEEP_DIR``.

The sweep's members (:mod:`nodescale.launch.sweep`) run as one Slurm or PBS array job, or here one
after another. For ``nodescale train`` a key is a configuration key or a train flag name, stored as
its configuration key; every member's whole configuration is validated before anything is submitted,
and a flag of the command that sets a swept key is left out of the job (the member's value wins).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from nodescale.errors import UserError, did_you_mean
from nodescale.launch import sweep_manifest, sweep_submit
from nodescale.launch.sweep import (
    RESUME_VARIABLE,
    Axis,
    check_size,
    check_trials,
    check_unique,
    env_name,
    expand,
    is_train,
    parse_axes,
    run_dir,
    yaml_value,
)
from nodescale.launch.sweep_manifest import Member, Sweep

_FLAGS = ("--trials", "--sweep-seed", "--max-concurrent")
# Keys the sweep sets itself.
_OWN_KEYS = {"out": "each member's run directory is SWEEP_DIR/mNNN (give the sweep's directory as train's --out)",
             "checkpoint.resume": "`nodescale launch --resubmit-failed SWEEP_DIR` resumes the failed members"}


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sweeps (one array job; a member per combination of settings)")
    group.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                       help="run the command once per value (repeatable: the keys cross); KEY is a configuration "
                            "key or a train flag for nodescale train, else the member gets NODESCALE_SWEEP_KEY; "
                            "KEY=log:LO:HI, lin:LO:HI or int:LO:HI draws --trials values")
    group.add_argument("--trials", metavar="N", help="values drawn for each range key (crossed with the grid keys)")
    group.add_argument("--sweep-seed", metavar="S", help="seed of the drawn values (default 0: the same every time)")
    group.add_argument("--max-concurrent", metavar="N", help="members running at once at most (Slurm %%N, PBS "
                       "max_run_subjobs; here: default 1)")
    group.add_argument("--resubmit-failed", metavar="SWEEP_DIR", help="submit the sweep's failed members again, "
                       "each resuming (nodescale train --resume)")


def wanted(args: argparse.Namespace) -> bool:
    return bool(args.sweep or args.resubmit_failed or any(getattr(args, flag[2:].replace("-", "_")) is not None
                                                           for flag in _FLAGS))


def run(args: argparse.Namespace) -> int:
    """Validate the sweep, then print its dry run, run it here, or submit it."""
    from nodescale.cli.launch_cmd import _count, build_spec, say_stop_handler

    if args.resubmit_failed:
        return resubmit(args)
    if not args.sweep:
        flag = next(flag for flag in _FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None)
        raise UserError(f"{flag} without --sweep", "sets how a sweep runs", "add --sweep KEY=V1,V2")
    spec, preset = build_spec(args)
    say_stop_handler(args, spec)
    axes = parse_axes(args.sweep)
    trials = _count("--trials", args.trials)
    seed = _count("--sweep-seed", args.sweep_seed, minimum=0) or 0
    check_trials(axes, trials)
    command, notes = list(spec.command), []
    if is_train(command):
        axes = _train_axes(axes)
        command, notes = train_command(command, [axis.key for axis in axes])
    else:
        check_unique([env_name(axis.key) for axis in axes], [axis.key for axis in axes])
    count = check_size(axes, trials, preset.max_array_size if preset else None, preset.name if preset else "local")
    if spec.scheduler == "pbs" and count == 1:
        raise UserError("a PBS sweep of 1 member", "is not an array: PBS's -J needs at least 2 members",
                        "sweep two values or more, or launch the one command without --sweep")
    directory = _sweep_dir(spec, command)
    if sweep_manifest.is_sweep(directory):
        raise UserError(f"sweep directory {directory}", "already holds a sweep",
                        f"rerun its failed members: nodescale launch --resubmit-failed {directory}; or choose "
                        "another train --out")
    members = [Member(index, settings, str(run_dir(directory, index)))
               for index, settings in enumerate(expand(axes, trials, seed))]
    if is_train(command):
        members = [_validated(member, command) for member in members]
    given = getattr(args, "argv", None) or []
    sweep = Sweep(name=spec.job_name, directory=directory, command=list(spec.command),
                  launch_argv=given[1:len(given) - len(args.command)], keys=[axis.key for axis in axes],
                  members=members, workdir=str(spec.workdir))
    return _go(args, spec, preset, sweep, command, [member.index for member in members], notes)


def resubmit(args: argparse.Namespace) -> int:
    """Submit the sweep's failed members again, with launch's flags as the sweep was first given them."""
    from nodescale.cli.launch_cmd import build_spec
    from nodescale.cli.main import build_parser

    sweep = sweep_manifest.read(Path(args.resubmit_failed).resolve())
    failed, counts = sweep_submit.failed_members(sweep)
    shown = ", ".join(f"{count} {state}" for state, count in sorted(counts.items()))
    if not failed:
        print(f"sweep {sweep.directory}: nothing failed ({shown})")
        return 0
    original = build_parser().parse_args(["launch", *sweep.launch_argv, "--", *sweep.command])
    original.dry_run = args.dry_run
    here = os.getcwd()
    os.chdir(sweep.workdir or here)  # launch's relative paths (--job-dir, ...) as they were given
    try:
        spec, preset = build_spec(original)
    finally:
        os.chdir(here)
    command, notes = (train_command(sweep.command, sweep.keys) if is_train(sweep.command)
                      else (list(sweep.command), []))
    print(f"sweep {sweep.directory}: {shown}; submitting the failed members again, each resuming")
    spec = spec.model_copy(update={"env": {**spec.env, RESUME_VARIABLE: "1"}})
    return _go(original, spec, preset, sweep, command, failed, notes, resume=True)


def _go(args: argparse.Namespace, spec: Any, preset: Any, sweep: Sweep, command: list[str], indices: list[int],
        notes: list[str], resume: bool = False) -> int:
    from nodescale.cli.launch_cmd import _count
    from nodescale.launch.schedulers.allocation import step_scheduler
    from nodescale.launch.schedulers.table import BATCH

    concurrent = _count("--max-concurrent", args.max_concurrent)
    print(f"sweep {sweep.name}: {len(indices)} member(s), directory {sweep.directory}")
    for note in notes:
        print(f"  note: {note}")
    # Inside an allocation this shell holds (salloc, qsub -I), the members are steps there, not new jobs.
    step = step_scheduler(BATCH[spec.scheduler]) if spec.scheduler in BATCH else None
    local = spec.scheduler == "local" or step is not None
    jobs = [] if local else sweep_submit.dryruns(BATCH[spec.scheduler], spec, preset, sweep, command, indices,
                                                 concurrent)
    if args.dry_run:
        sweep_submit.print_table(sweep, indices)
        if step is not None:
            print(f"# runs in {step.name} allocation {step.job_id}, {concurrent or 1} at a time: each member a step "
                  "there with its settings")
        elif local:
            print(f"# runs here, {concurrent or 1} at a time: each member's command with its settings")
        for job in jobs:
            print(job.show(), end="")
        return 0
    if resume:
        sweep_submit.forget_status(sweep, indices)
    sweep.directory.mkdir(parents=True, exist_ok=True)
    sweep_manifest.write(sweep)
    if local:
        if step is not None:
            print(f"nodescale: in {step.name} allocation {step.job_id}: each member runs as a step there (no new "
                  "job)", flush=True)
        return sweep_submit.run_here(sweep, spec, command, indices, resume, concurrent, step, preset)
    sweep_submit.submit(BATCH[spec.scheduler], sweep, jobs, resume)
    return 0


def _sweep_dir(spec: Any, command: list[str]) -> Path:
    """train's --out DIR, else JOB_DIR/sweeps/NAME-TIME."""
    out = _train_parser().parse_args(command[2:]).out if is_train(command) else None
    if out:
        return (spec.workdir / out).resolve()
    return spec.job_dir / "sweeps" / f"{spec.job_name}-{time.strftime('%Y%m%d-%H%M%S')}"


class _TrainParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UserError(f"nodescale train's flags after -- ({message})", "cannot be read",
                        "check them: nodescale train --help")


def _train_parser() -> argparse.ArgumentParser:
    from nodescale.cli.run_flags import add_run_flags

    parser = _TrainParser(prog="nodescale train", add_help=False)
    add_run_flags(parser)
    return parser


def _train_axes(axes: list[Axis]) -> list[Axis]:
    """The axes with their configuration keys (``batch-size`` -> ``train.batch_size``)."""
    from nodescale.cli.run_flags import FLAGS

    keys = []
    for axis in axes:
        name = axis.key if axis.key.startswith("--") else f"--{axis.key}"
        flag = next((flag for flag in FLAGS if flag.name == name), None)
        if flag is None and "." not in axis.key:
            guess = did_you_mean(name, [flag.name for flag in FLAGS])
            raise UserError(f"--sweep {axis.key}", "is neither a configuration key (section.name) nor a flag of "
                            "nodescale train", f"did you mean {guess}?" if guess else "e.g. optim.lr or batch-size")
        key = flag.key if flag else axis.key
        if key in _OWN_KEYS:
            raise UserError(f"--sweep {axis.key}", "is set by the sweep itself", _OWN_KEYS[key])
        keys.append(key)
    check_unique(keys, [axis.key for axis in axes])
    return [axis.with_key(key) for axis, key in zip(axes, keys, strict=True)]


def train_command(command: list[str], keys: list[str]) -> tuple[list[str], list[str]]:
    """The train command without its own settings of the swept keys (flags win over --set), and a note on each."""
    from nodescale.cli.run_flags import FLAGS

    flags = {flag.name: flag for flag in FLAGS if flag.key in keys}
    kept, notes, i = command[:2], [], 2
    while i < len(command):
        word = command[i]
        name, eq, rest = word.partition("=")
        takes = 1 if (name in flags and flags[name].switch is None and not eq) or (name == "--set" and not eq) else 0
        following = command[i + 1] if takes and i + 1 < len(command) else ""
        assigned = (rest if eq else following).partition("=")[0].strip()
        key = flags[name].key if name in flags else assigned if name == "--set" and assigned in keys else None
        if key is None:
            kept.append(word)
            i += 1
            continue
        notes.append(f"the command's {' '.join(command[i:i + 1 + takes])} gives way to each member's {key}")
        i += 1 + takes
    left = _train_parser().parse_args(kept[2:])
    for key in keys:  # an abbreviated flag (--batch 32) still sets it
        if getattr(left, key.replace(".", "__"), None) is not None:
            raise UserError(f"the command's flag for {key}", "would override the sweep's values",
                            f"drop it: the sweep gives every member its {key}")
    return kept, notes


def _validated(member: Member, command: list[str]) -> Member:
    """``member`` with its settings as the validated configuration types them; UserError naming the member."""
    from nodescale.cli.run_flags import resolve_config

    words = [word for key, value in member.settings.items()
             for word in ("--set", f"{key}={value if isinstance(value, str) else yaml_value(value)}")]
    try:
        cfg = resolve_config(_train_parser().parse_args([*command[2:], *words, "--out", member.run_dir]))
    except UserError as exc:
        shown = " ".join(f"{key}={value}" for key, value in member.settings.items())
        raise UserError(f"sweep member {member.index} ({shown}): {exc.what}", exc.rule, exc.hint) from None
    tree = cfg.model_dump(mode="json")
    typed = {}
    for key, value in member.settings.items():
        node: Any = tree
        for part in key.split("."):
            node = node.get(part, value) if isinstance(node, dict) else value
        typed[key] = node
    return Member(member.index, typed, member.run_dir)
